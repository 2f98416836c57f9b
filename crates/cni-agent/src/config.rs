//! Configuration plumbing every part shares: Istio's flag and environment names (a flag `--a-b-c`
//! is also read from `A_B_C`; flag > env > default), parsed by clap and validated into plain
//! config structs. Each part's own settings live next to it: [`crate::install::config`],
//! [`crate::ambient::config`], [`crate::repair::config`] and [`crate::logging::LogArgs`].
//!
//! The environment is read through [`EnvSource`] instead of clap's own `env` lookup, so tests
//! supply a map and nothing ever mutates the process environment: [`parse_from`] rewrites each
//! argument's `env` into a default taken from the source before clap parses.

use std::collections::HashMap;
use std::ffi::OsString;

use clap::{CommandFactory, FromArgMatches};

/// Where environment values come from.
pub trait EnvSource {
    fn get(&self, key: &str) -> Option<String>;
}

/// The real process environment.
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

impl<K: std::borrow::Borrow<str> + std::hash::Hash + Eq, V: AsRef<str>> EnvSource
    for HashMap<K, V>
{
    fn get(&self, key: &str) -> Option<String> {
        HashMap::get(self, key).map(|v| v.as_ref().to_string())
    }
}

/// Parses `argv` for the command `C`, taking environment fallbacks from `env`. An empty
/// environment value counts as unset, as it does for Istio's viper.
pub fn parse_from<C, I, T>(argv: I, env: &dyn EnvSource) -> Result<C, clap::Error>
where
    C: CommandFactory + FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let mut cmd = C::command().mut_args(|arg| {
        let Some(name) = arg.get_env().and_then(|n| n.to_str()).map(str::to_string) else {
            return arg;
        };
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let arg = arg
            .env(None::<&'static str>)
            .help(format!("{help} [env: {name}]"));
        match env.get(&name).filter(|v| !v.is_empty()) {
            Some(value) => arg.default_value(value),
            None => arg,
        }
    });
    let matches = cmd.try_get_matches_from_mut(argv)?;
    C::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))
}

/// Go's `strconv.ParseBool`, which is what Istio accepts for its boolean settings.
pub fn go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("{s:?} is not a boolean (true/false)")),
    }
}

/// File permission bits as Go's `strconv.ParseInt(s, 0, 0)` reads them (so `0600` is octal and
/// `384` decimal), limited to permission bits: a decimal `600` is rejected instead of silently
/// meaning `0o1130`.
pub fn file_mode(s: &str) -> Result<u32, String> {
    let t = s.trim();
    let parsed = if let Some(hex) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        u32::from_str_radix(hex, 16)
    } else if let Some(oct) = t.strip_prefix("0o").or_else(|| t.strip_prefix("0O")) {
        u32::from_str_radix(oct, 8)
    } else if t.len() > 1 && t.starts_with('0') {
        u32::from_str_radix(&t[1..], 8)
    } else {
        t.parse()
    };
    match parsed {
        Ok(m) if m <= 0o777 => Ok(m),
        Ok(m) => Err(format!(
            "{s:?} = {m:#o} has bits outside 0777 (octal needs a leading 0, e.g. 0600)"
        )),
        Err(e) => Err(format!("{s:?} is not a file mode: {e}")),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid {option}: {reason}")]
    Invalid {
        option: &'static str,
        reason: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(option: &'static str, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            option,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn process_environment_is_not_consulted_by_parse_from() {
        // PATH is always set; a test-only arg bound to it must stay unset when the map lacks it.
        #[derive(Parser, Debug)]
        struct P {
            #[arg(long, env = "PATH")]
            path: Option<String>,
        }
        let empty: HashMap<&str, &str> = HashMap::new();
        let p: P = parse_from(["x"], &empty).unwrap();
        assert_eq!(p.path, None);
        let p: P = parse_from(["x"], &HashMap::from([("PATH", "/bin")])).unwrap();
        assert_eq!(p.path.as_deref(), Some("/bin"));
    }
}
