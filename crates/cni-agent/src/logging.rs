//! The agent's log output, driven by Istio's `istio.io/pkg/log` flags (see [`LogArgs`]): level per
//! scope, JSON or text, targets (`--log_target`: `stdout`, `stderr`, file paths), caller
//! locations (`--log_caller`) and a size-rotated file (`--log_rotate*`). Every event is formatted
//! once and written whole to each target.

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{ArgAction, Args};
use dataplane::logfile::{RotatingFile, Rotation};
use tracing_subscriber::fmt::MakeWriter;

use crate::config::{ConfigError, go_bool};

/// Istio's logging flags (`istio.io/pkg/log`; names kept with underscores, as Helm passes them).
/// [`crate::logging`] applies them.
#[derive(Args, Debug, Clone)]
pub struct LogArgs {
    /// `level` or `scope:level,...` (scopes: cni-agent, cni-plugin); e.g. `info` or `cni-plugin:debug`.
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
    /// Scopes whose records carry the source location (`cni-agent`, or `default` for all).
    #[arg(long = "log_caller", default_value = "", global = true)]
    pub log_caller: String,
    /// `level` or `scope:level,...` from which Istio adds stack traces; accepted and validated,
    /// but a Rust log site has no stack to print.
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

const LEVELS: [&str; 6] = ["none", "fatal", "error", "warn", "info", "debug"];

/// The level `spec` (`level` or `scope:level,...`) gives `scope`, else its unscoped level, else
/// `default`.
fn scoped_level(
    option: &'static str,
    spec: &str,
    scope: &str,
    default: &'static str,
) -> Result<String, ConfigError> {
    let mut unscoped = default;
    let mut scoped = None;
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (s, level) = match part.split_once(':') {
            Some((s, l)) => (Some(s), l),
            None => (None, part),
        };
        if !LEVELS.contains(&level) {
            return Err(ConfigError::invalid(
                option,
                format!("unknown level {level:?}"),
            ));
        }
        match s {
            // Istio's catch-all scope sets the default like an unscoped level.
            None | Some("default") => unscoped = level,
            Some(s) if s == scope => scoped = Some(level),
            Some(_) => {}
        }
    }
    Ok(scoped.unwrap_or(unscoped).to_string())
}

impl LogArgs {
    /// Level of `scope`, falling back to the unscoped level, then `info`.
    pub fn level_of(&self, scope: &str) -> Result<String, ConfigError> {
        scoped_level("--log_output_level", &self.log_output_level, scope, "info")
    }

    /// `--log_stacktrace_level` of `scope`.
    pub fn stacktrace_level_of(&self, scope: &str) -> Result<String, ConfigError> {
        scoped_level(
            "--log_stacktrace_level",
            &self.log_stacktrace_level,
            scope,
            "none",
        )
    }
}

/// The scope every agent component logs under; plugin records are re-emitted as `cni-plugin`.
pub const AGENT_SCOPE: &str = "cni-agent";

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

/// Where log events go; cloning shares the open files.
#[derive(Clone)]
pub struct LogOutputs {
    targets: Arc<Vec<Target>>,
    /// Escape colours only when every target is a terminal.
    pub ansi: bool,
}

impl LogOutputs {
    /// Opens the targets the flags name; an unopenable path is an error naming its flag.
    pub fn from_args(log: &LogArgs) -> Result<Self, ConfigError> {
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
        let ansi = !targets.is_empty()
            && targets.iter().all(|t| match t {
                Target::Stdout => std::io::stdout().is_terminal(),
                Target::Stderr => std::io::stderr().is_terminal(),
                _ => false,
            });
        Ok(LogOutputs {
            targets: Arc::new(targets),
            ansi,
        })
    }
}

/// One event's writer: each write goes to every target.
pub struct EventWriter<'a>(&'a [Target]);

impl Write for EventWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for t in self.0 {
            t.write(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogOutputs {
    type Writer = EventWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        EventWriter(&self.targets)
    }
}

fn tracing_level(level: &str) -> tracing_subscriber::filter::LevelFilter {
    use tracing_subscriber::filter::LevelFilter;
    match level {
        "none" => LevelFilter::OFF,
        "fatal" | "error" => LevelFilter::ERROR,
        "warn" => LevelFilter::WARN,
        "debug" => LevelFilter::DEBUG,
        _ => LevelFilter::INFO,
    }
}

/// Installs the global subscriber described by the flags.
pub fn init(log: &LogArgs) -> Result<(), ConfigError> {
    let level = tracing_level(&log.level_of(AGENT_SCOPE)?);
    // Validated for a clear error; Rust log sites carry no stack, so there is nothing to print.
    log.stacktrace_level_of(AGENT_SCOPE)?;
    let outputs = LogOutputs::from_args(log)?;
    let caller = log.caller_enabled(AGENT_SCOPE);
    let builder = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(outputs.ansi)
        .with_writer(outputs)
        .with_target(false)
        .with_file(caller)
        .with_line_number(caller);
    if log.log_as_json {
        builder.json().init();
    } else {
        builder.init();
    }
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

    /// Whether `--log_caller` names `scope` (or Istio's catch-all `default` scope).
    pub fn caller_enabled(&self, scope: &str) -> bool {
        self.log_caller
            .split(',')
            .map(str::trim)
            .any(|s| s == scope || s == "default")
    }
}
