//! The agent's log output in Istio's format (`istio.io/istio/pkg/log`, zap underneath), driven by
//! Istio's flags (see [`LogArgs`]), so log pipelines and alerts written for Istio's agent keep
//! working. `tools/istio/log-golden` writes the same records through Istio's own logger and
//! `tests/agent/log_format.rs` compares the two line by line.
//!
//! - Text: `time<TAB>level<TAB>scope<TAB>[caller<TAB>]msg[<TAB>k=v k=v]`, then the stack on the
//!   next lines. The `default` scope prints no scope column.
//! - JSON (`--log_as_json`): `{"level","time","scope","caller","msg",<labels>...,"stack"}`.
//! - Scopes: everything the agent does logs as `cni-agent`, the plugin's records re-emitted from
//!   `log.sock` as `cni-plugin` (with the plugin's own time), other crates' records (kube, hyper)
//!   as `default`. Each scope has its own level, stack trace level and caller flag.
//! - The flags follow Istio's `processLevels`: `level` alone sets the `default` scope only,
//!   `all:level` sets every scope, `scope:level` one scope, applied left to right. Istio skips a
//!   scope it does not know; we refuse it at start, naming the scopes, so a typo does not leave
//!   a scope silently at info. All of Istio's agent's scopes are accepted.
//! - Levels cannot be changed at runtime: Istio's agent serves ctrlz (`--ctrlz_port`, on the
//!   node's loopback) for that; we have no ctrlz (see docs/troubleshooting.md).
//!
//! Every record is formatted once and written whole to each target.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use clap::{ArgAction, Args};
use dataplane::logfile::{RotatingFile, Rotation};
use serde_json::Value;
use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::{ConfigError, go_bool};

/// Istio's logging flags (`istio.io/pkg/log`; names kept with underscores, as Helm passes them).
/// [`crate::logging`] applies them.
#[derive(Args, Debug, Clone)]
pub struct LogArgs {
    /// `level` (the `default` scope), `scope:level,...` or `all:level`; e.g.
    /// `cni-agent:debug,cni-plugin:debug`. Scopes: [`ISTIO_SCOPES`].
    #[arg(long = "log_output_level", default_value = "info", global = true)]
    pub log_output_level: String,
    /// Log JSON lines instead of text.
    #[arg(long = "log_as_json", default_value = "false", action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_parser = go_bool, global = true)]
    pub log_as_json: bool,
    /// Where logs go: `stdout`, `stderr` or file paths (comma-separated or repeated). Default
    /// stderr, not Istio's stdout: stdout carries command output (`install --once`, `explain`).
    #[arg(
        long = "log_target",
        default_value = "stderr",
        value_delimiter = ',',
        global = true
    )]
    pub log_target: Vec<String>,
    /// Scopes whose records carry the source location (e.g. `cni-agent`, or `all`).
    #[arg(long = "log_caller", default_value = "", global = true)]
    pub log_caller: String,
    /// `level` or `scope:level,...` from which records carry a stack trace (`stack`).
    #[arg(long = "log_stacktrace_level", default_value = "none", global = true)]
    pub log_stacktrace_level: String,
    /// A file that also receives the logs, rotated by size.
    #[arg(long = "log_rotate", global = true)]
    pub log_rotate: Option<PathBuf>,
    /// Size in megabytes at which the `--log_rotate` file is rotated.
    #[arg(
        long = "log_rotate_max_size",
        default_value = "104857600",
        global = true
    )]
    pub log_rotate_max_size: u64,
    /// Rotated files kept (0: no limit).
    #[arg(long = "log_rotate_max_backups", default_value = "1000", global = true)]
    pub log_rotate_max_backups: u32,
    /// Rotated files older than this many days are deleted at rotation (0: no limit).
    #[arg(long = "log_rotate_max_age", default_value = "30", global = true)]
    pub log_rotate_max_age: u32,
}

/// The scopes Istio's install-cni registers (`log-golden scopes`, checked by
/// `tests/agent/log_format.rs`): the names its log flags accept.
pub const ISTIO_SCOPES: &[&str] = &[
    "ads",
    "cni-agent",
    "cni-plugin",
    "controllers",
    "default",
    "grpc",
    "klog",
    "krt",
    "model",
    "monitoring",
    "spiffe",
    "trustBundle",
    "validation",
];

/// The scope every agent component logs under.
pub const AGENT_SCOPE: &str = "cni-agent";
/// The scope of the plugin's records re-emitted from `log.sock`.
pub const PLUGIN_SCOPE: &str = "cni-plugin";
/// Istio's unnamed scope (no scope column): here, other crates' records.
pub const DEFAULT_SCOPE: &str = "default";
/// Istio's `OverrideScopeName`: every scope at once.
const OVERRIDE_SCOPE: &str = "all";

/// Istio's levels; a scope at level `L` writes records at `L` and below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    None,
    Fatal,
    Error,
    Warn,
    Info,
    Debug,
}

impl Level {
    const ALL: [Level; 6] = [
        Level::Debug,
        Level::Info,
        Level::Warn,
        Level::Error,
        Level::Fatal,
        Level::None,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Level::None => "none",
            Level::Fatal => "fatal",
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }

    pub fn parse(s: &str) -> Option<Level> {
        Level::ALL.into_iter().find(|l| l.name() == s)
    }

    /// Tracing has no fatal and Istio no trace: trace records are never written.
    fn of(level: &tracing::Level) -> Option<Level> {
        match *level {
            tracing::Level::ERROR => Some(Level::Error),
            tracing::Level::WARN => Some(Level::Warn),
            tracing::Level::INFO => Some(Level::Info),
            tracing::Level::DEBUG => Some(Level::Debug),
            tracing::Level::TRACE => None,
        }
    }
}

fn known_scope(option: &'static str, scope: &str) -> Result<&'static str, ConfigError> {
    ISTIO_SCOPES
        .iter()
        .copied()
        .find(|s| *s == scope)
        .ok_or_else(|| {
            ConfigError::invalid(
                option,
                format!(
                    "unknown scope {scope:?} (scopes: {OVERRIDE_SCOPE}, {})",
                    ISTIO_SCOPES.join(", ")
                ),
            )
        })
}

/// A level per scope: `initial`, then each `scope:level` of `spec` in turn (Istio's
/// `processLevels`; see the module doc).
fn scope_levels(
    option: &'static str,
    spec: &str,
    initial: &[(&'static str, Level)],
) -> Result<Vec<(&'static str, Level)>, ConfigError> {
    let mut levels: Vec<_> = ISTIO_SCOPES.iter().map(|s| (*s, Level::Info)).collect();
    let parts = initial.iter().map(|(s, l)| (Some(*s), l.name())).chain(
        spec.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| match p.split_once(':') {
                Some((s, l)) => (Some(s), l),
                None => (None, p),
            }),
    );
    for (scope, level) in parts {
        let l = Level::parse(level).ok_or_else(|| {
            ConfigError::invalid(
                option,
                format!(
                    "unknown level {level:?} (levels: {})",
                    Level::ALL.map(Level::name).join(", ")
                ),
            )
        })?;
        match scope.unwrap_or(DEFAULT_SCOPE) {
            OVERRIDE_SCOPE => levels.iter_mut().for_each(|(_, v)| *v = l),
            s => {
                let s = known_scope(option, s)?;
                levels
                    .iter_mut()
                    .filter(|(n, _)| *n == s)
                    .for_each(|(_, v)| *v = l);
            }
        }
    }
    Ok(levels)
}

fn level_in(levels: &[(&'static str, Level)], scope: &str) -> Level {
    levels
        .iter()
        .find(|(s, _)| *s == scope)
        .map_or(Level::None, |(_, l)| *l)
}

impl LogArgs {
    /// `--log_output_level` per scope, from Istio's defaults (`default:info,grpc:none`).
    fn output_levels(&self) -> Result<Vec<(&'static str, Level)>, ConfigError> {
        scope_levels(
            "--log_output_level",
            &self.log_output_level,
            &[(DEFAULT_SCOPE, Level::Info), ("grpc", Level::None)],
        )
    }

    /// `--log_stacktrace_level` per scope (Istio's default: none).
    fn stacktrace_levels(&self) -> Result<Vec<(&'static str, Level)>, ConfigError> {
        scope_levels(
            "--log_stacktrace_level",
            &self.log_stacktrace_level,
            &[(OVERRIDE_SCOPE, Level::None)],
        )
    }

    /// The output level of `scope` (the plugin is told its own, `cni-plugin`'s, as Istio does).
    pub fn level_of(&self, scope: &str) -> Result<String, ConfigError> {
        Ok(level_in(&self.output_levels()?, scope).name().to_string())
    }

    /// The scopes `--log_caller` names (`all`: every scope).
    fn callers(&self) -> Result<Vec<&'static str>, ConfigError> {
        let mut out = Vec::new();
        for s in self
            .log_caller
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            if s == OVERRIDE_SCOPE {
                return Ok(ISTIO_SCOPES.to_vec());
            }
            out.push(known_scope("--log_caller", s)?);
        }
        Ok(out)
    }
}

enum Target {
    Stdout,
    Stderr,
    File(Mutex<File>),
    Rotating(Mutex<RotatingFile>),
}

impl Target {
    fn write(&self, buf: &[u8]) {
        // A failing log target must not take the agent down; the other targets still get it.
        match self {
            Target::Stdout => {
                let _ = std::io::stdout().lock().write_all(buf);
            }
            Target::Stderr => {
                let _ = std::io::stderr().lock().write_all(buf);
            }
            Target::File(f) => {
                let _ = f.lock().unwrap().write_all(buf);
            }
            Target::Rotating(f) => {
                let _ = f.lock().unwrap().append(buf);
            }
        }
    }
}

/// Where log records go.
struct LogOutputs(Vec<Target>);

impl LogOutputs {
    /// Opens the targets the flags name; an unopenable path is an error naming its flag.
    fn from_args(log: &LogArgs) -> Result<Self, ConfigError> {
        let mut targets = Vec::new();
        for t in log
            .log_target
            .iter()
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
        {
            targets.push(match t {
                "stdout" => Target::Stdout,
                "stderr" => Target::Stderr,
                path => Target::File(Mutex::new(
                    OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(path)
                        .map_err(|e| ConfigError::Invalid {
                            option: "--log_target",
                            reason: format!("{path}: {e}"),
                        })?,
                )),
            });
        }
        if let Some(path) = log
            .log_rotate
            .as_ref()
            .filter(|p| !p.as_os_str().is_empty())
        {
            targets.push(Target::Rotating(Mutex::new(RotatingFile::new(
                path.clone(),
                log.rotation()?,
            ))));
        }
        Ok(LogOutputs(targets))
    }
}

/// One record, as Istio's `Scope.emit` builds it.
struct Record<'a> {
    time: &'a str,
    level: Level,
    scope: &'static str,
    /// `dir/file:line` (zap's short caller).
    caller: Option<String>,
    msg: &'a str,
    /// Already in the output's form: see [`Labels`].
    labels: &'a Labels,
    stack: Option<String>,
}

/// A record's labels, written as they are visited in the one form the output takes: `k=v k=v`
/// in text (strings bare, other values as JSON, as Go's `fmt.Sprint` prints them), `"k":v,...`
/// in JSON. A record used to collect them as JSON values and format each twice, which was most
/// of the allocations of a pod's ADD (its one "enrolled" line has seven labels).
struct Labels {
    json: bool,
    out: Vec<u8>,
}

impl Labels {
    fn new(json: bool) -> Self {
        Labels {
            json,
            out: Vec::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.out.is_empty()
    }

    fn key(&mut self, key: &str) {
        if !self.out.is_empty() {
            self.out.push(if self.json { b',' } else { b' ' });
        }
        if self.json {
            json_str(&mut self.out, key);
            self.out.push(b':');
        } else {
            self.out.extend_from_slice(key.as_bytes());
            self.out.push(b'=');
        }
    }

    fn str(&mut self, key: &str, value: &str) {
        self.key(key);
        if self.json {
            json_str(&mut self.out, value);
        } else {
            self.out.extend_from_slice(value.as_bytes());
        }
    }

    /// A value whose text is its JSON (numbers, booleans, JSON values).
    fn json_text(&mut self, key: &str, value: impl std::fmt::Display) {
        self.key(key);
        let _ = write!(self.out, "{value}");
    }

    fn debug(&mut self, key: &str, value: &dyn std::fmt::Debug) {
        if self.json {
            self.str(key, &format!("{value:?}"));
        } else {
            self.key(key);
            let _ = write!(self.out, "{value:?}");
        }
    }

    fn value(&mut self, key: &str, value: &Value) {
        match value {
            Value::String(s) => self.str(key, s),
            other => self.json_text(key, other),
        }
    }
}

/// `s` as a JSON string.
fn json_str(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(out, s).expect("a string serializes into memory");
}

impl Record<'_> {
    fn render(&self, json: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(160 + self.msg.len() + self.labels.out.len());
        if json {
            self.json(&mut out);
        } else {
            self.text(&mut out);
        }
        out
    }

    fn text(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.time.as_bytes());
        let mut column = |s: &str| {
            out.push(b'\t');
            out.extend_from_slice(s.as_bytes());
        };
        column(self.level.name());
        if self.scope != DEFAULT_SCOPE {
            column(self.scope);
        }
        if let Some(c) = &self.caller {
            column(c);
        }
        column(self.msg);
        if !self.labels.is_empty() {
            out.push(b'\t');
            out.extend_from_slice(&self.labels.out);
        }
        if let Some(stack) = &self.stack {
            out.push(b'\n');
            out.extend_from_slice(stack.as_bytes());
        }
        out.push(b'\n');
    }

    fn json(&self, out: &mut Vec<u8>) {
        // Keys in zap's order; serde_json's map would sort them.
        let mut field = |key: &str, value: &str| {
            out.push(if out.is_empty() { b'{' } else { b',' });
            json_str(out, key);
            out.push(b':');
            json_str(out, value);
        };
        field("level", self.level.name());
        field("time", self.time);
        if self.scope != DEFAULT_SCOPE {
            field("scope", self.scope);
        }
        if let Some(c) = &self.caller {
            field("caller", c);
        }
        field("msg", self.msg);
        if !self.labels.is_empty() {
            out.push(b',');
            out.extend_from_slice(&self.labels.out);
        }
        if let Some(stack) = &self.stack {
            out.push(b',');
            json_str(out, "stack");
            out.push(b':');
            json_str(out, stack);
        }
        out.extend_from_slice(b"}\n");
    }
}

/// The agent's logger: a tracing [`Layer`], and the writer of the plugin's re-emitted records
/// ([`emit_plugin_record`]).
pub struct IstioLog {
    json: bool,
    levels: Vec<(&'static str, Level)>,
    stack_levels: Vec<(&'static str, Level)>,
    callers: Vec<&'static str>,
    outputs: LogOutputs,
}

impl IstioLog {
    pub fn from_args(log: &LogArgs) -> Result<Self, ConfigError> {
        Ok(IstioLog {
            json: log.log_as_json,
            levels: log.output_levels()?,
            stack_levels: log.stacktrace_levels()?,
            callers: log.callers()?,
            outputs: LogOutputs::from_args(log)?,
        })
    }

    fn enabled(&self, scope: &str, level: Level) -> bool {
        level != Level::None && level <= level_in(&self.levels, scope)
    }

    fn wanted(&self, meta: &Metadata<'_>) -> bool {
        meta.is_event()
            && Level::of(meta.level()).is_some_and(|l| self.enabled(scope_of(meta.target()), l))
    }

    fn write(&self, record: &Record<'_>) {
        let line = record.render(self.json);
        for t in &self.outputs.0 {
            t.write(&line);
        }
    }

    /// Istio's `dumpStack`: the `default` scope dumps a stack for records at or above its stack
    /// trace level, but every other scope for *all* its records once that level reaches error
    /// (`cni-agent:error` puts a stack on info records too). It tells the scopes apart by
    /// pointer, and `WithLabels` returns a copy: a `default` record with labels counts as
    /// another scope's. tests/agent/log_format.rs holds us to all of it.
    fn stack(&self, scope: &str, level: Level, labelled: bool) -> Option<String> {
        let threshold = if scope == DEFAULT_SCOPE && !labelled {
            level
        } else {
            Level::Error
        };
        (level_in(&self.stack_levels, scope) >= threshold)
            .then(|| std::backtrace::Backtrace::force_capture().to_string())
    }
}

/// The scope of a tracing target: a scope's own name (as `log.sock` uses), the agent's crates,
/// or `default` for everything else.
fn scope_of(target: &str) -> &'static str {
    const AGENT_CRATES: [&str; 3] = ["cni_agent", "dataplane", "cni_core"];
    if let Some(s) = ISTIO_SCOPES.iter().find(|s| **s == target) {
        return s;
    }
    let krate = target.split("::").next().unwrap_or(target);
    if AGENT_CRATES.contains(&krate) {
        AGENT_SCOPE
    } else {
        DEFAULT_SCOPE
    }
}

/// Collects an event's message and its other fields, in order, as labels.
struct Fields {
    msg: String,
    labels: Labels,
}

impl Fields {
    /// Whether `field` is a label (not the message, nor the `log` crate's metadata).
    fn is_label(field: &Field) -> bool {
        field.name() != "message" && !field.name().starts_with("log.")
    }

    /// A value whose text is its JSON, in either output form.
    fn record_json_text(&mut self, field: &Field, value: impl std::fmt::Display) {
        use std::fmt::Write as _;
        if field.name() == "message" {
            let _ = write!(self.msg, "{value}");
        } else if Self::is_label(field) {
            self.labels.json_text(field.name(), value);
        }
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.msg.push_str(value);
        } else if Self::is_label(field) {
            self.labels.str(field.name(), value);
        }
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.record_json_text(field, value);
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_json_text(field, value);
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.record_json_text(field, value);
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        // serde_json's spelling (`1.0`, `null` for NaN), not Rust's (`1`, `NaN`).
        self.record_json_text(field, Value::from(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        if field.name() == "message" {
            let _ = write!(self.msg, "{value:?}");
        } else if Self::is_label(field) {
            self.labels.debug(field.name(), value);
        }
    }
}

impl<S: Subscriber> Layer<S> for IstioLog {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        // Levels are fixed for the process, so each call site is decided once. Spans (the kube
        // client's) carry nothing Istio's format shows: none is recorded.
        if self.wanted(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        self.wanted(meta)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        let max = self.levels.iter().map(|(_, l)| *l).max();
        Some(match max {
            Some(Level::Debug) => LevelFilter::DEBUG,
            Some(Level::Info) => LevelFilter::INFO,
            Some(Level::Warn) => LevelFilter::WARN,
            Some(Level::Error | Level::Fatal) => LevelFilter::ERROR,
            Some(Level::None) | None => LevelFilter::OFF,
        })
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let Some(level) = Level::of(meta.level()) else {
            return;
        };
        let scope = scope_of(meta.target());
        let mut fields = Fields {
            msg: String::new(),
            labels: Labels::new(self.json),
        };
        event.record(&mut fields);
        let time = cni_core::cmdadd::log_time(std::time::SystemTime::now());
        let caller = self
            .callers
            .contains(&scope)
            .then(|| short_caller(meta.file(), meta.line()));
        self.write(&Record {
            time: &time,
            level,
            scope,
            caller,
            msg: &fields.msg,
            labels: &fields.labels,
            stack: self.stack(scope, level, !fields.labels.is_empty()),
        });
    }
}

/// zap's `ShortCallerEncoder`: the file's directory and name, and the line.
fn short_caller(file: Option<&str>, line: Option<u32>) -> String {
    let file = file.unwrap_or("?");
    let short = match file.rmatch_indices('/').nth(1) {
        Some((i, _)) => &file[i + 1..],
        None => file,
    };
    format!("{short}:{}", line.unwrap_or(0))
}

/// Writes one of the plugin's records (from `log.sock`) as `cni-plugin`, with the plugin's time
/// and labels, as Istio's agent does (`LogWithTime`). `level` is the plugin's; records at levels
/// the plugin does not send (`fatal`, unknown) are dropped, as Istio drops them.
#[track_caller]
pub fn emit_plugin_record(level: &str, time: &str, msg: &str, labels: &[(String, Value)]) {
    let Some(level) = Level::parse(level).filter(|l| *l >= Level::Error) else {
        return;
    };
    let site = std::panic::Location::caller();
    tracing::dispatcher::get_default(|d| {
        let Some(log) = d.downcast_ref::<IstioLog>() else {
            return;
        };
        if !log.enabled(PLUGIN_SCOPE, level) {
            return;
        }
        let mut rendered = Labels::new(log.json);
        for (k, v) in labels {
            rendered.value(k, v);
        }
        log.write(&Record {
            time,
            level,
            scope: PLUGIN_SCOPE,
            caller: log
                .callers
                .contains(&PLUGIN_SCOPE)
                .then(|| short_caller(Some(site.file()), Some(site.line()))),
            msg,
            labels: &rendered,
            stack: log.stack(PLUGIN_SCOPE, level, !labels.is_empty()),
        });
    });
}

/// The error and its causes, each once: most of our errors embed their source in their own text
/// *and* return it from `source()`, so anyhow's `{:#}` printed a cause up to three times
/// (`copying binaries: reading /x: ENOENT: reading /x: ENOENT: ENOENT`); a cause the text above
/// already spells out is skipped.
pub fn describe_error(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

/// Installs the logger the flags describe as the process's subscriber.
pub fn init(log: &LogArgs) -> Result<(), ConfigError> {
    tracing_subscriber::registry()
        .with(IstioLog::from_args(log)?)
        .init();
    Ok(())
}

impl LogArgs {
    /// `--log_rotate_max_size` (MB), `--log_rotate_max_backups` and `--log_rotate_max_age`
    /// (days), with Istio's "0 means no limit" for the last two.
    pub fn rotation(&self) -> Result<Rotation, ConfigError> {
        if self.log_rotate_max_size == 0 {
            return Err(ConfigError::Invalid {
                option: "--log_rotate_max_size",
                reason: "must be at least 1 (megabytes)".into(),
            });
        }
        Ok(Rotation {
            max_bytes: self.log_rotate_max_size.saturating_mul(1024 * 1024),
            max_backups: match self.log_rotate_max_backups {
                0 => u32::MAX,
                n => n,
            },
            max_age: (self.log_rotate_max_age > 0)
                .then(|| Duration::from_secs(u64::from(self.log_rotate_max_age) * 86_400)),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;

    fn all_kinds(json: bool) -> String {
        let mut l = Labels::new(json);
        l.str("pod", "ns/p \"q\"");
        l.json_text("n", -2);
        l.json_text("ok", false);
        l.json_text("f", Value::from(1.0));
        l.debug("took", &Duration::from_micros(1500));
        l.value("obj", &json!({"a": [1, "b"]}));
        l.value("s", &json!("bare"));
        String::from_utf8(l.out).unwrap()
    }

    #[test]
    fn labels_are_strings_bare_and_the_rest_json_in_text() {
        assert_eq!(
            all_kinds(false),
            r#"pod=ns/p "q" n=-2 ok=false f=1.0 took=1.5ms obj={"a":[1,"b"]} s=bare"#
        );
    }

    #[test]
    fn labels_are_json_members_in_json() {
        assert_eq!(
            all_kinds(true),
            r#""pod":"ns/p \"q\"","n":-2,"ok":false,"f":1.0,"took":"1.5ms","obj":{"a":[1,"b"]},"s":"bare""#
        );
    }

    #[test]
    fn a_record_renders_in_zaps_column_and_key_order() {
        let mut labels = Labels::new(false);
        labels.str("pod", "a/b");
        let mut record = Record {
            time: "2026-12-06T21:00:00.000000Z",
            level: Level::Warn,
            scope: "cni-agent",
            caller: Some("mesh/add.rs:10".into()),
            msg: "slow \"pod\"",
            labels: &labels,
            stack: Some("frame".into()),
        };
        assert_eq!(
            String::from_utf8(record.render(false)).unwrap(),
            "2026-12-06T21:00:00.000000Z\twarn\tcni-agent\tmesh/add.rs:10\tslow \"pod\"\tpod=a/b\nframe\n"
        );
        let mut json_labels = Labels::new(true);
        json_labels.str("pod", "a/b");
        record.labels = &json_labels;
        record.scope = DEFAULT_SCOPE;
        record.caller = None;
        let line = String::from_utf8(record.render(true)).unwrap();
        assert_eq!(
            line,
            "{\"level\":\"warn\",\"time\":\"2026-12-06T21:00:00.000000Z\",\"msg\":\"slow \\\"pod\\\"\",\"pod\":\"a/b\",\"stack\":\"frame\"}\n"
        );
        serde_json::from_str::<Value>(&line).expect("one JSON object");
    }

    /// What [`Fields`] makes of an event, in both forms.
    struct Capture {
        json: bool,
        seen: Arc<Mutex<Vec<(String, String)>>>,
    }

    impl<S: Subscriber> Layer<S> for Capture {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let mut fields = Fields {
                msg: String::new(),
                labels: Labels::new(self.json),
            };
            event.record(&mut fields);
            let labels = String::from_utf8(fields.labels.out).unwrap();
            self.seen.lock().unwrap().push((fields.msg, labels));
        }
    }

    fn captured(json: bool) -> (String, String) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let layer = Capture {
            json,
            seen: seen.clone(),
        };
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
            tracing::info!(
                pod = %"ns/p",
                n = 3u64,
                ok = true,
                x = 0.5,
                took = ?Duration::from_millis(2),
                "hello {}",
                1
            );
        });
        let mut seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        seen.pop().unwrap()
    }

    #[test]
    fn an_events_message_and_fields_become_the_records() {
        assert_eq!(
            captured(false),
            (
                "hello 1".to_string(),
                "pod=ns/p n=3 ok=true x=0.5 took=2ms".to_string()
            )
        );
        assert_eq!(
            captured(true),
            (
                "hello 1".to_string(),
                r#""pod":"ns/p","n":3,"ok":true,"x":0.5,"took":"2ms""#.to_string()
            )
        );
    }
}
