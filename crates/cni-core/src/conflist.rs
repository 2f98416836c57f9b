//! CNI network configuration files as the container runtime reads them (libcni's validity rules)
//! and the edits the installer makes to them: chaining the `istio-cni` entry into a primary
//! config, wrapping a single-plugin `.conf` into a list, and removing the entry again.
//!
//! Unlike Istio, which re-marshals the whole document from a generic map (sorting keys, pushing
//! numbers through float64, HTML-escaping), every edit here splices the document text: only the
//! span of the `plugins` array changes, and the existing plugin entries inside it keep their exact
//! bytes. A document we cannot parse is reported as an error and never rewritten.

use std::ops::Range;

use serde::Serialize;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

/// `type` (and `name`) of the entry the installer chains into the primary config.
pub const PLUGIN_TYPE: &str = "istio-cni";
/// `name` of the list created when a single-plugin `.conf` is converted.
pub const WRAPPER_NAME: &str = "k8s-pod-network";
/// `cniVersion` of everything the installer creates (the standalone entry, the `.conf` wrapper).
pub const WRITTEN_CNI_VERSION: &str = "0.3.1";

#[derive(Debug, thiserror::Error)]
pub enum ConfError {
    #[error("invalid JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error("not valid UTF-8")]
    NotUtf8,
    #[error("top-level value is not a JSON object")]
    NotAnObject,
    #[error("no name")]
    NoName,
    #[error("`{key}` has the wrong type: {detail}")]
    FieldType { key: &'static str, detail: String },
    #[error("`loadOnlyInlinedPlugins` is true, and no `plugins` key")]
    InlinedWithoutPlugins,
    #[error("no plugins in list")]
    EmptyPlugins,
    #[error("no plugin configs found")]
    NoPlugins,
    #[error("plugin {index}: {reason}")]
    Plugin { index: usize, reason: String },
    #[error("missing 'type'")]
    MissingType,
    #[error("no `plugins` array to chain into")]
    NoPluginList,
}

fn field_type(key: &'static str, detail: impl Into<String>) -> ConfError {
    ConfError::FieldType {
        key,
        detail: detail.into(),
    }
}

/// What libcni learns from a `.conflist` file before it looks at `<dir>/<name>/*.conf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListSummary {
    pub name: String,
    /// Plugins written inside the file.
    pub inline_plugins: usize,
    /// When false, libcni also loads plugin files from `<confdir>/<name>/*.conf`.
    pub load_only_inlined: bool,
}

/// Validates a `.conflist` the way libcni's `ConfListFromBytes` does. The caller still has to
/// reject a list whose total plugin count (inline plus `<dir>/<name>/*.conf`) is zero, which is
/// how a `"pugins"` typo makes a file invalid.
pub fn parse_list(bytes: &[u8]) -> Result<ListSummary, ConfError> {
    let value: Value = serde_json::from_slice(bytes).map_err(ConfError::Json)?;
    let obj = value.as_object().ok_or(ConfError::NotAnObject)?;
    let name = match obj.get("name") {
        None => return Err(ConfError::NoName),
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(field_type("name", kind_of(other))),
    };
    if let Some(v) = obj.get("cniVersion")
        && !v.is_string()
    {
        return Err(field_type("cniVersion", kind_of(v)));
    }
    if let Some(v) = obj.get("cniVersions") {
        let list = v
            .as_array()
            .ok_or_else(|| field_type("cniVersions", kind_of(v)))?;
        if let Some(bad) = list.iter().find(|v| !v.is_string()) {
            return Err(field_type(
                "cniVersions",
                format!("element {}", kind_of(bad)),
            ));
        }
    }
    for key in ["disableCheck", "disableGC"] {
        go_bool(obj.get(key), key)?;
    }
    let load_only_inlined = go_bool(obj.get("loadOnlyInlinedPlugins"), "loadOnlyInlinedPlugins")?;
    let inline_plugins = match obj.get("plugins") {
        None if load_only_inlined => return Err(ConfError::InlinedWithoutPlugins),
        None => 0,
        Some(Value::Array(plugins)) if plugins.is_empty() => return Err(ConfError::EmptyPlugins),
        Some(Value::Array(plugins)) => {
            for (index, plugin) in plugins.iter().enumerate() {
                check_plugin(plugin).map_err(|e| ConfError::Plugin {
                    index,
                    reason: e.to_string(),
                })?;
            }
            plugins.len()
        }
        Some(other) => return Err(field_type("plugins", kind_of(other))),
    };
    Ok(ListSummary {
        name,
        inline_plugins,
        load_only_inlined,
    })
}

/// Validates a single-plugin `.conf` (libcni `ConfFromBytes`): a JSON object with a non-empty
/// `type`. A `.conf` without `name` is still valid.
pub fn parse_single(bytes: &[u8]) -> Result<(), ConfError> {
    let value: Value = serde_json::from_slice(bytes).map_err(ConfError::Json)?;
    check_plugin(&value)
}

/// libcni decodes every plugin into its `NetConf` struct; a field of the wrong JSON type is a
/// decode error there, and an empty or missing `type` is rejected afterwards.
fn check_plugin(plugin: &Value) -> Result<(), ConfError> {
    let obj = plugin.as_object().ok_or(ConfError::NotAnObject)?;
    let string_or_null = |key: &'static str| match obj.get(key) {
        None | Some(Value::Null | Value::String(_)) => Ok(()),
        Some(other) => Err(field_type(key, kind_of(other))),
    };
    string_or_null("cniVersion")?;
    string_or_null("name")?;
    string_or_null("type")?;
    match obj.get("capabilities") {
        None | Some(Value::Null) => {}
        Some(Value::Object(caps)) => {
            if caps.values().any(|v| !v.is_boolean() && !v.is_null()) {
                return Err(field_type("capabilities", "non-boolean value"));
            }
        }
        Some(other) => return Err(field_type("capabilities", kind_of(other))),
    }
    match obj.get("ipam") {
        None | Some(Value::Null) => {}
        Some(Value::Object(ipam)) => match ipam.get("type") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(other) => return Err(field_type("ipam", format!("type is {}", kind_of(other)))),
        },
        Some(other) => return Err(field_type("ipam", kind_of(other))),
    }
    match obj.get("dns") {
        None | Some(Value::Null) => {}
        Some(Value::Object(dns)) => {
            for key in ["nameservers", "search", "options"] {
                match dns.get(key) {
                    None | Some(Value::Null) => {}
                    Some(Value::Array(items))
                        if items.iter().all(|i| i.is_string() || i.is_null()) => {}
                    Some(_) => {
                        return Err(field_type("dns", format!("{key} is not a list of strings")));
                    }
                }
            }
            if let Some(d) = dns.get("domain")
                && !(d.is_string() || d.is_null())
            {
                return Err(field_type("dns", "domain is not a string"));
            }
        }
        Some(other) => return Err(field_type("dns", kind_of(other))),
    }
    match obj.get("prevResult") {
        None | Some(Value::Null | Value::Object(_)) => {}
        Some(other) => return Err(field_type("prevResult", kind_of(other))),
    }
    match obj.get("type") {
        Some(Value::String(t)) if !t.is_empty() => Ok(()),
        _ => Err(ConfError::MissingType),
    }
}

/// libcni accepts a JSON bool or the strings "true"/"false" in any case.
fn go_bool(value: Option<&Value>, key: &'static str) -> Result<bool, ConfError> {
    match value {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(true),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(false),
        Some(other) => Err(field_type(key, format!("{other} is not a boolean"))),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The settings the plugin reads from its entry in the CNI config (Istio's `plugin.Config`).
#[derive(Debug, Clone, PartialEq)]
pub struct IstioEntry {
    pub plugin_log_level: String,
    pub cni_agent_run_dir: String,
    pub ambient_enabled: bool,
    /// Already normalised to `[{"podSelector": …, "namespaceSelector": …}, …]`.
    pub enablement_selectors: Value,
    /// `None` serialises as `null`, as Istio does for an empty `EXCLUDE_NAMESPACES`.
    pub exclude_namespaces: Option<Vec<String>>,
    pub pod_namespace: String,
    pub native_nftables: bool,
    pub enable_ambient_detection_retry: bool,
}

/// Field order is Istio's struct order; `ipam` and `dns` are always present (empty objects).
#[derive(Serialize)]
struct EntryJson<'a> {
    #[serde(rename = "cniVersion", skip_serializing_if = "Option::is_none")]
    cni_version: Option<&'static str>,
    name: &'static str,
    #[serde(rename = "type")]
    kind: &'static str,
    ipam: serde_json::Map<String, Value>,
    dns: serde_json::Map<String, Value>,
    plugin_log_level: &'a str,
    cni_agent_run_dir: &'a str,
    ambient_enabled: bool,
    enablement_selectors: &'a Value,
    exclude_namespaces: Option<&'a [String]>,
    pod_namespace: &'a str,
    native_nftables: bool,
    enable_ambient_detection_retry: bool,
}

impl IstioEntry {
    fn json(&self, with_version: bool) -> EntryJson<'_> {
        EntryJson {
            cni_version: with_version.then_some(WRITTEN_CNI_VERSION),
            name: PLUGIN_TYPE,
            kind: PLUGIN_TYPE,
            ipam: serde_json::Map::new(),
            dns: serde_json::Map::new(),
            plugin_log_level: &self.plugin_log_level,
            cni_agent_run_dir: &self.cni_agent_run_dir,
            ambient_enabled: self.ambient_enabled,
            enablement_selectors: &self.enablement_selectors,
            exclude_namespaces: self.exclude_namespaces.as_deref(),
            pod_namespace: &self.pod_namespace,
            native_nftables: self.native_nftables,
            enable_ambient_detection_retry: self.enable_ambient_detection_retry,
        }
    }

    /// The whole file written in standalone mode: the entry with `cniVersion`, 2-space indent,
    /// trailing newline.
    pub fn standalone_file(&self) -> String {
        let mut out = pretty(&self.json(true));
        out.push('\n');
        out
    }

    /// The entry as it appears inside a list (no `cniVersion`; the list's version applies).
    pub fn chained_value(&self) -> Value {
        serde_json::to_value(self.json(false)).expect("entry serialises")
    }

    fn chained_text(&self, indent: Option<&str>) -> String {
        match indent {
            Some(indent) => reindent(&pretty(&self.json(false)), indent),
            None => serde_json::to_string(&self.json(false)).expect("entry serialises"),
        }
    }
}

fn pretty<T: Serialize>(v: &T) -> String {
    serde_json::to_string_pretty(v).expect("entry serialises")
}

/// Shifts every line after the first; JSON strings cannot contain raw newlines, so this only
/// ever changes insignificant whitespace.
fn reindent(text: &str, indent: &str) -> String {
    text.replace('\n', &format!("\n{indent}"))
}

/// The top-level members of a JSON object in document order, each value borrowed from the text.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    out.push((key, map.next_value::<&'de RawValue>()?));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Byte range of `part` inside `whole`; `part` must be a subslice of `whole` (as every borrowed
/// `RawValue` is of the text it was parsed from).
fn span_of(whole: &str, part: &str) -> Range<usize> {
    let start = part.as_ptr() as usize - whole.as_ptr() as usize;
    debug_assert!(start + part.len() <= whole.len());
    start..start + part.len()
}

fn skip_ws(text: &str, mut at: usize) -> usize {
    while matches!(text.as_bytes().get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// Parses `text` as a JSON object and returns its members with the byte span of each value.
fn object_members(text: &str) -> Result<Vec<(String, Range<usize>)>, ConfError> {
    let trimmed = text.trim_start_matches([' ', '\t', '\n', '\r']);
    if !trimmed.starts_with('{') {
        // Still report a JSON syntax error when there is one, as that is the more useful message.
        serde_json::from_str::<&RawValue>(text).map_err(ConfError::Json)?;
        return Err(ConfError::NotAnObject);
    }
    let members: Members<'_> = serde_json::from_str(text).map_err(ConfError::Json)?;
    Ok(members
        .0
        .into_iter()
        .map(|(k, v)| (k, span_of(text, v.get())))
        .collect())
}

/// Element spans of the JSON array occupying `text[array]`.
fn array_elements(text: &str, array: Range<usize>) -> Result<Vec<Range<usize>>, ConfError> {
    let raw = &text[array];
    let elements: Vec<&RawValue> = serde_json::from_str(raw).map_err(ConfError::Json)?;
    Ok(elements.iter().map(|e| span_of(text, e.get())).collect())
}

fn is_array(text: &str, span: &Range<usize>) -> bool {
    text.as_bytes().get(span.start) == Some(&b'[')
}

/// The `plugins` member the runtime sees (the last one, if a document repeats the key).
fn plugins_span(members: &[(String, Range<usize>)]) -> Option<Range<usize>> {
    members
        .iter()
        .rev()
        .find(|(k, _)| k == "plugins")
        .map(|(_, span)| span.clone())
}

fn splice(text: &str, range: Range<usize>, with: &str) -> String {
    let mut out = String::with_capacity(text.len() + with.len());
    out.push_str(&text[..range.start]);
    out.push_str(with);
    out.push_str(&text[range.end..]);
    out
}

/// Index of the first element whose `type` is `istio-cni`; every element must be an object.
fn find_istio(text: &str, elements: &[Range<usize>]) -> Result<Option<usize>, ConfError> {
    for (index, span) in elements.iter().enumerate() {
        let value: Value = serde_json::from_str(&text[span.clone()]).map_err(ConfError::Json)?;
        let obj = value.as_object().ok_or_else(|| ConfError::Plugin {
            index,
            reason: "not a JSON object".into(),
        })?;
        if obj.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE) {
            return Ok(Some(index));
        }
    }
    Ok(None)
}

/// Removes element `index` from the array `text` (the array's own text) with the separator that
/// belonged to it, leaving the remaining elements' bytes untouched.
fn remove_element(text: &str, elements: &[Range<usize>], index: usize) -> String {
    if elements.len() == 1 {
        return splice(text, 1..text.len() - 1, "");
    }
    if index > 0 {
        splice(text, elements[index - 1].end..elements[index].end, "")
    } else {
        splice(text, elements[0].start..elements[1].start, "")
    }
}

/// Appends our entry to the array `array` (its own text), copying the separator and indentation
/// the array already uses. `line_indent` is the indentation of the line holding the array's key,
/// used when the array is empty.
fn append_entry(
    array: &str,
    entry: &IstioEntry,
    line_indent: Option<&str>,
) -> Result<String, ConfError> {
    let elements = array_elements(array, 0..array.len())?;
    let Some(last) = elements.last() else {
        return Ok(match line_indent {
            Some(indent) => {
                let inner = format!("{indent}  ");
                format!("[\n{inner}{}\n{indent}]", entry.chained_text(Some(&inner)))
            }
            None => format!("[{}]", entry.chained_text(None)),
        });
    };
    let separator = match elements.len() {
        1 => format!(",{}", &array[1..elements[0].start]),
        n => array[elements[n - 2].end..elements[n - 1].start].to_string(),
    };
    let indent = separator.rfind('\n').map(|nl| &separator[nl + 1..]);
    let text = format!("{separator}{}", entry.chained_text(indent));
    Ok(splice(array, last.end..last.end, &text))
}

/// Indentation of the line containing byte `at`, or `None` when the document is a single line
/// (then we keep it compact).
fn line_indent(text: &str, at: usize) -> Option<&str> {
    if !text.contains('\n') {
        return None;
    }
    let start = text[..at].rfind('\n').map_or(0, |nl| nl + 1);
    let line = &text[start..];
    let len = line.len() - line.trim_start_matches([' ', '\t']).len();
    Some(&line[..len])
}

/// Chains our entry into `existing`:
/// - a single-plugin config (a top-level `type` key) becomes
///   `{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[<it without cniVersion>, <entry>]}`;
/// - a list keeps every byte outside its `plugins` array; inside it, the first existing
///   `istio-cni` element is removed and ours is appended.
///
/// An edit the runtime would reject is refused: the existing plugins keep their bytes, so a
/// broken one would make the whole written list invalid (found by the `conflist_edit` fuzzer: a
/// plugin without `type`, e.g. in a file changed after discovery validated it).
pub fn insert_entry(existing: &[u8], entry: &IstioEntry) -> Result<String, ConfError> {
    let edited = splice_entry(existing, entry)?;
    parse_list(edited.as_bytes())?;
    Ok(edited)
}

fn splice_entry(existing: &[u8], entry: &IstioEntry) -> Result<String, ConfError> {
    let text = std::str::from_utf8(existing).map_err(|_| ConfError::NotUtf8)?;
    let members = object_members(text)?;
    if members.iter().any(|(k, _)| k == "type") {
        return wrap_single(text, entry);
    }
    let span = plugins_span(&members).ok_or(ConfError::NoPluginList)?;
    if !is_array(text, &span) {
        return Err(ConfError::NoPluginList);
    }
    let mut array = text[span.clone()].to_string();
    let elements = array_elements(&array, 0..array.len())?;
    if let Some(index) = find_istio(&array, &elements)? {
        array = remove_element(&array, &elements, index);
    }
    let array = append_entry(&array, entry, line_indent(text, span.start))?;
    Ok(splice(text, span, &array))
}

fn wrap_single(text: &str, entry: &IstioEntry) -> Result<String, ConfError> {
    let mut plugin = text.trim_matches([' ', '\t', '\n', '\r']).to_string();
    // Repeated keys are all dropped, as a decode into a map would keep only one of them anyway.
    loop {
        let members = object_members(&plugin)?;
        let Some(k) = members.iter().position(|(key, _)| key == "cniVersion") else {
            break;
        };
        plugin = remove_member(&plugin, &members, k);
    }
    let indent = "    ";
    Ok(format!(
        "{{\n  \"cniVersion\": \"{WRITTEN_CNI_VERSION}\",\n  \"name\": \"{WRAPPER_NAME}\",\n  \"plugins\": [\n{indent}{},\n{indent}{}\n  ]\n}}\n",
        reindent(&plugin, indent),
        entry.chained_text(Some(indent)),
    ))
}

/// Removes member `k` (key, colon, value and one adjoining comma) from the object `text`.
fn remove_member(text: &str, members: &[(String, Range<usize>)], k: usize) -> String {
    let open = skip_ws(text, 0);
    let key_start = |i: usize| {
        if i == 0 {
            skip_ws(text, open + 1)
        } else {
            skip_ws(text, skip_ws(text, members[i - 1].1.end) + 1)
        }
    };
    if members.len() == 1 {
        let close = text.trim_end_matches([' ', '\t', '\n', '\r']).len() - 1;
        return splice(text, open + 1..close, "");
    }
    if k > 0 {
        splice(text, members[k - 1].1.end..members[k].1.end, "")
    } else {
        splice(text, key_start(0)..key_start(1), "")
    }
}

/// Removes the first `istio-cni` element from a list's `plugins`; `Ok(None)` when there is none
/// (including single-plugin configs, which never carry our entry).
pub fn remove_entry(existing: &[u8]) -> Result<Option<String>, ConfError> {
    let text = std::str::from_utf8(existing).map_err(|_| ConfError::NotUtf8)?;
    let members = object_members(text)?;
    let Some(span) = plugins_span(&members).filter(|s| is_array(text, s)) else {
        return Ok(None);
    };
    let array = &text[span.clone()];
    let elements = array_elements(array, 0..array.len())?;
    let Some(index) = find_istio(array, &elements)? else {
        return Ok(None);
    };
    Ok(Some(splice(
        text,
        span,
        &remove_element(array, &elements, index),
    )))
}

/// Byte range of the `plugins` array the edits above splice (the last `plugins` key), or `None`
/// when the document has no such array. Everything outside it is what an edit must not change;
/// public so property tests and the fuzzer can check exactly that.
pub fn plugins_range(existing: &[u8]) -> Result<Option<Range<usize>>, ConfError> {
    let text = std::str::from_utf8(existing).map_err(|_| ConfError::NotUtf8)?;
    let members = object_members(text)?;
    Ok(plugins_span(&members).filter(|s| is_array(text, s)))
}

/// What an installed config holds, for the installer's validity check.
#[derive(Debug, Clone, PartialEq)]
pub struct ListContents {
    /// `type` of each plugin, in order.
    pub types: Vec<String>,
    /// Our entry (the first `istio-cni` plugin), if present.
    pub istio_entry: Option<Value>,
}

/// Reads a list's plugins; every plugin must be an object with a string `type`.
pub fn list_contents(existing: &[u8]) -> Result<ListContents, ConfError> {
    let value: Value = serde_json::from_slice(existing).map_err(ConfError::Json)?;
    let obj = value.as_object().ok_or(ConfError::NotAnObject)?;
    let plugins = obj
        .get("plugins")
        .and_then(Value::as_array)
        .ok_or(ConfError::NoPluginList)?;
    let mut out = ListContents {
        types: Vec::with_capacity(plugins.len()),
        istio_entry: None,
    };
    for (index, plugin) in plugins.iter().enumerate() {
        let kind = plugin
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| ConfError::Plugin {
                index,
                reason: "type is not a string".into(),
            })?;
        if kind == PLUGIN_TYPE && out.istio_entry.is_none() {
            out.istio_entry = Some(plugin.clone());
        }
        out.types.push(kind.to_string());
    }
    Ok(out)
}

/// The top-level `type` of a single-plugin config (standalone mode checks it is ours).
pub fn single_type(existing: &[u8]) -> Result<Option<String>, ConfError> {
    let value: Value = serde_json::from_slice(existing).map_err(ConfError::Json)?;
    let obj = value.as_object().ok_or(ConfError::NotAnObject)?;
    Ok(obj.get("type").and_then(Value::as_str).map(str::to_string))
}

#[cfg(test)]
mod tests;
