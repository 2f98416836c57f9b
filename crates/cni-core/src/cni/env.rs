//! The `CNI_*` environment and the checks libcni's `skel` makes before any handler runs, in the
//! same order and with the same codes and messages, so a runtime sees the same failures it saw
//! from Istio's Go plugin.

use std::collections::HashMap;
use std::hash::BuildHasher;

use super::error::{CniError, code};
use super::version;

/// Where the `CNI_*` variables come from: the process environment in the plugin, a map in tests
/// (so no test ever mutates its own environment).
pub trait EnvSource {
    fn var(&self, key: &str) -> Option<String>;
}

impl<S: BuildHasher> EnvSource for HashMap<String, String, S> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key).cloned()
    }
}

impl<S: BuildHasher> EnvSource for HashMap<&str, &str, S> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key).map(|v| (*v).to_owned())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Gc,
    Status,
    Version,
    /// Anything else: rejected only after the config was validated, as libcni does.
    Other(String),
}

impl Command {
    pub fn parse(s: &str) -> Command {
        match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "GC" => Command::Gc,
            "STATUS" => Command::Status,
            "VERSION" => Command::Version,
            other => Command::Other(other.to_owned()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Gc => "GC",
            Command::Status => "STATUS",
            Command::Version => "VERSION",
            Command::Other(s) => s,
        }
    }
}

/// The per-invocation variables (stdin is read separately: never for VERSION).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CmdArgs {
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    pub args: String,
    pub path: String,
    pub netns_override: String,
}

impl CmdArgs {
    /// `CNI_NETNS_OVERRIDE` is "true" (any case) or "1": the runtime allows `CNI_NETNS` to be the
    /// plugin's own namespace.
    pub fn netns_override(&self) -> bool {
        self.netns_override.eq_ignore_ascii_case("true") || self.netns_override == "1"
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invocation {
    /// No `CNI_COMMAND`: print the about text to stderr and exit 0.
    About,
    Run {
        command: Command,
        args: CmdArgs,
    },
}

type Validator = fn(&str) -> Result<(), CniError>;

/// Reads the environment as libcni `skel` does: each variable in a fixed order, required ones per
/// command collected into one "missing" error, present required ones validated on the spot.
pub fn read_env(env: &dyn EnvSource) -> Result<Invocation, CniError> {
    let get = |k: &str| env.var(k).unwrap_or_default();
    let cmd_text = get("CNI_COMMAND");
    let command = Command::parse(&cmd_text);
    use Command::*;
    let req = |cmds: &[Command]| cmds.contains(&command);
    let vars: [(&str, bool, Option<Validator>); 7] = [
        ("CNI_COMMAND", true, None),
        (
            "CNI_CONTAINERID",
            req(&[Add, Check, Del]),
            Some(validate_container_id),
        ),
        ("CNI_NETNS", req(&[Add, Check]), None),
        (
            "CNI_IFNAME",
            req(&[Add, Check, Del]),
            Some(validate_interface_name),
        ),
        ("CNI_ARGS", false, None),
        ("CNI_PATH", req(&[Add, Check, Del, Gc, Status]), None),
        ("CNI_NETNS_OVERRIDE", false, None),
    ];
    let mut missing = Vec::new();
    for (name, required, validate) in vars {
        let value = get(name);
        if value.is_empty() {
            if required {
                missing.push(name);
            }
        } else if let (true, Some(validate)) = (required && name != "CNI_COMMAND", validate) {
            validate(&value)?;
        }
    }
    if !missing.is_empty() {
        if cmd_text.is_empty() {
            return Ok(Invocation::About);
        }
        return Err(CniError::new(
            code::INVALID_ENV,
            format!("required env variables [{}] missing", missing.join(",")),
        ));
    }
    Ok(Invocation::Run {
        command,
        args: CmdArgs {
            container_id: get("CNI_CONTAINERID"),
            netns: get("CNI_NETNS"),
            ifname: get("CNI_IFNAME"),
            args: get("CNI_ARGS"),
            path: get("CNI_PATH"),
            netns_override: get("CNI_NETNS_OVERRIDE"),
        },
    })
}

/// What the about text says (to stderr, when there is no `CNI_COMMAND`).
pub fn about_text(about: &str) -> String {
    format!(
        "{about}\nCNI protocol versions supported: {}\n",
        version::SUPPORTED.join(", ")
    )
}

/// The stdin checks libcni makes before calling a handler: a JSON object with a valid `name`, then
/// the version rules of the command. Returns the config's `cniVersion` (0.1.0 when absent).
/// Not called for VERSION, whose stdin is never read.
pub fn check_stdin(command: &Command, stdin: &[u8]) -> Result<String, CniError> {
    validate_config(stdin)?;
    let conf_version = version::decode(stdin)?;
    let min = match command {
        Command::Add | Command::Del => None,
        Command::Check => Some("0.4.0"),
        Command::Gc | Command::Status => Some("1.1.0"),
        Command::Version => return Ok(conf_version),
        Command::Other(c) => {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("unknown CNI_COMMAND: {c}"),
            ));
        }
    };
    if let Some(min) = min {
        let name = command.as_str();
        if !version::at_least(&conf_version, min)? {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!("config version does not allow {name}"),
            ));
        }
        if !version::at_least(version::CURRENT, &conf_version)? {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!("plugin version does not allow {name}"),
            ));
        }
    }
    version::check_supported(&conf_version)?;
    Ok(conf_version)
}

fn validate_config(stdin: &[u8]) -> Result<(), CniError> {
    let decode_err = |what: String| {
        CniError::new(
            code::DECODING_FAILURE,
            format!("error unmarshall network config: {what}"),
        )
    };
    let value: serde_json::Value =
        serde_json::from_slice(stdin).map_err(|e| decode_err(e.to_string()))?;
    let obj = value.as_object().ok_or_else(|| {
        decode_err(format!(
            "cannot unmarshal {} into a network config",
            kind(&value)
        ))
    })?;
    let name = match obj.get("name") {
        None | Some(serde_json::Value::Null) => "",
        Some(serde_json::Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(decode_err(format!(
                "cannot unmarshal {} into field name",
                kind(other)
            )));
        }
    };
    if name.is_empty() {
        return Err(CniError::new(
            code::INVALID_NETWORK_CONFIG,
            "missing network name",
        ));
    }
    if !valid_name(name) {
        return Err(CniError::with_details(
            code::INVALID_NETWORK_CONFIG,
            "invalid characters found in network name",
            name,
        ));
    }
    Ok(())
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "bool",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// libcni's `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$` for container IDs and network names.
fn valid_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

fn validate_container_id(id: &str) -> Result<(), CniError> {
    if !valid_name(id) {
        return Err(CniError::with_details(
            code::INVALID_ENV,
            "invalid characters in containerID",
            id,
        ));
    }
    Ok(())
}

/// The kernel's interface name rules (`dev_valid_name`), as libcni checks them.
fn validate_interface_name(name: &str) -> Result<(), CniError> {
    if name.len() > 15 {
        return Err(CniError::with_details(
            code::INVALID_ENV,
            "interface name is too long",
            "interface name should be less than 16 characters",
        ));
    }
    if name == "." || name == ".." {
        return Err(CniError::new(
            code::INVALID_ENV,
            "interface name is . or ..",
        ));
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        return Err(CniError::new(
            code::INVALID_ENV,
            "interface name contains / or : or whitespace characters",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&'static str, &'static str)]) -> HashMap<&'static str, &'static str> {
        pairs.iter().copied().collect()
    }

    const FULL: [(&str, &str); 6] = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc123"),
        ("CNI_NETNS", "/var/run/netns/cni-1"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        ("CNI_ARGS", "K8S_POD_NAME=a"),
    ];

    #[test]
    fn reads_a_full_add() {
        let inv = read_env(&env(&FULL)).unwrap();
        let Invocation::Run { command, args } = inv else {
            panic!("not run")
        };
        assert_eq!(command, Command::Add);
        assert_eq!(args.container_id, "abc123");
        assert_eq!(args.netns, "/var/run/netns/cni-1");
        assert_eq!(args.ifname, "eth0");
        assert_eq!(args.args, "K8S_POD_NAME=a");
        assert!(!args.netns_override());
    }

    #[test]
    fn no_command_is_about() {
        assert_eq!(read_env(&env(&[])).unwrap(), Invocation::About);
        assert_eq!(
            read_env(&env(&[("CNI_PATH", "/x")])).unwrap(),
            Invocation::About
        );
    }

    #[test]
    fn missing_vars_are_listed_in_order() {
        let e = read_env(&env(&[("CNI_COMMAND", "ADD")])).unwrap_err();
        assert_eq!(e.code, 4);
        assert_eq!(
            e.msg,
            "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME,CNI_PATH] missing"
        );
        // DEL does not need a netns; GC and STATUS only need CNI_PATH.
        let e = read_env(&env(&[("CNI_COMMAND", "DEL")])).unwrap_err();
        assert_eq!(
            e.msg,
            "required env variables [CNI_CONTAINERID,CNI_IFNAME,CNI_PATH] missing"
        );
        let e = read_env(&env(&[("CNI_COMMAND", "GC")])).unwrap_err();
        assert_eq!(e.msg, "required env variables [CNI_PATH] missing");
        assert!(matches!(
            read_env(&env(&[("CNI_COMMAND", "VERSION")])).unwrap(),
            Invocation::Run {
                command: Command::Version,
                ..
            }
        ));
    }

    #[test]
    fn present_values_are_validated_before_missing_ones_are_reported() {
        let e = read_env(&env(&[("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "-bad")])).unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str(), e.details.as_str()),
            (4, "invalid characters in containerID", "-bad")
        );
        let mut e2 = env(&FULL);
        e2.insert("CNI_IFNAME", "a-very-long-ifname");
        assert_eq!(read_env(&e2).unwrap_err().msg, "interface name is too long");
        e2.insert("CNI_IFNAME", "..");
        assert_eq!(read_env(&e2).unwrap_err().msg, "interface name is . or ..");
        e2.insert("CNI_IFNAME", "et h0");
        assert_eq!(
            read_env(&e2).unwrap_err().msg,
            "interface name contains / or : or whitespace characters"
        );
        // Not required for GC, so not validated either.
        let gc = env(&[
            ("CNI_COMMAND", "GC"),
            ("CNI_PATH", "/x"),
            ("CNI_CONTAINERID", "-bad"),
        ]);
        assert!(read_env(&gc).is_ok());
    }

    #[test]
    fn netns_override_values() {
        for (v, want) in [
            ("true", true),
            ("TRUE", true),
            ("1", true),
            ("0", false),
            ("yes", false),
        ] {
            let a = CmdArgs {
                netns_override: v.into(),
                ..Default::default()
            };
            assert_eq!(a.netns_override(), want, "{v}");
        }
    }

    #[test]
    fn stdin_checks() {
        let ok = br#"{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"istio-cni"}"#;
        assert_eq!(check_stdin(&Command::Add, ok).unwrap(), "1.0.0");
        let e = check_stdin(&Command::Add, b"{").unwrap_err();
        assert_eq!(e.code, 6);
        assert!(
            e.msg.starts_with("error unmarshall network config: "),
            "{}",
            e.msg
        );
        assert_eq!(check_stdin(&Command::Add, b"[]").unwrap_err().code, 6);
        assert_eq!(
            check_stdin(&Command::Add, br#"{"name":5}"#)
                .unwrap_err()
                .code,
            6
        );
        let e = check_stdin(&Command::Add, br#"{"cniVersion":"1.0.0"}"#).unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (7, "missing network name"));
        let e = check_stdin(&Command::Add, br#"{"name":"a b"}"#).unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (7, "invalid characters found in network name")
        );
        let e = check_stdin(&Command::Add, br#"{"name":"n","cniVersion":"0.5.0"}"#).unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (1, "incompatible CNI versions"));
        // No cniVersion means 0.1.0, which ADD accepts.
        assert_eq!(
            check_stdin(&Command::Add, br#"{"name":"n"}"#).unwrap(),
            "0.1.0"
        );
    }

    #[test]
    fn check_gc_status_version_gates() {
        let conf = |v: &str| format!(r#"{{"name":"n","cniVersion":"{v}"}}"#).into_bytes();
        let e = check_stdin(&Command::Check, &conf("0.3.1")).unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (1, "config version does not allow CHECK")
        );
        assert_eq!(
            check_stdin(&Command::Check, &conf("0.4.0")).unwrap(),
            "0.4.0"
        );
        let e = check_stdin(&Command::Check, &conf("2.0.0")).unwrap_err();
        assert_eq!(e.msg, "plugin version does not allow CHECK");
        let e = check_stdin(&Command::Check, &conf("0.4.1")).unwrap_err();
        assert_eq!(e.msg, "incompatible CNI versions");
        for c in [Command::Gc, Command::Status] {
            let e = check_stdin(&c, &conf("1.0.0")).unwrap_err();
            assert_eq!(
                e.msg,
                format!("config version does not allow {}", c.as_str())
            );
            assert_eq!(check_stdin(&c, &conf("1.1.0")).unwrap(), "1.1.0");
        }
        let e = check_stdin(&Command::Other("FOO".into()), &conf("1.0.0")).unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (4, "unknown CNI_COMMAND: FOO"));
        // The config is still validated first.
        assert_eq!(
            check_stdin(&Command::Other("FOO".into()), b"{}")
                .unwrap_err()
                .code,
            7
        );
    }

    #[test]
    fn about_lists_versions() {
        assert_eq!(
            about_text("CNI plugin istio-cni 0.1.0"),
            "CNI plugin istio-cni 0.1.0\nCNI protocol versions supported: 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0\n"
        );
    }
}
