//! Plugin logging. stdout belongs to the CNI protocol, so records go to stderr (the runtime keeps
//! it) as JSON lines; once the config names the agent's run dir they are also buffered and, at
//! exit, handed to the agent over `<run dir>/log.sock` (`POST /log`, a JSON array of strings, one
//! record each), so `kubectl logs` on the agent shows what the plugin did. That hand-off takes
//! 1 s at most. When it fails (no socket, agent down, non-200), the records at info and above go
//! to the node-local `<run dir>/istio-cni.log` instead (Istio's file name and size: 10 MB, one
//! backup, two days), so an operator on the node sees why ADDs failed while the agent was away.
//! Istio tees every record there; writing only what the agent did not get keeps the hot path free
//! of file I/O and the file free of duplicates.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use cni_core::cmdadd::{LOG_PATH, LOG_SOCKET};
use dataplane::logfile::{RotatingFile, Rotation};
use serde_json::{Map, Value};

use crate::http::{self, Deadline, Request};

/// Istio's plugin log file in the agent run dir.
pub const LOG_FILE: &str = "istio-cni.log";
/// Istio's rotation of that file (lumberjack: 10 MB, 1 backup, 2 days).
pub const LOG_FILE_ROTATION: Rotation = Rotation {
    max_bytes: 10 * 1024 * 1024,
    max_backups: 1,
    max_age: Some(Duration::from_secs(2 * 86_400)),
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
    /// Nothing is logged.
    None,
}

impl Level {
    /// `plugin_log_level`; anything unrecognised (including empty) keeps the default, info.
    pub fn parse(s: &str) -> Level {
        match s.to_ascii_lowercase().as_str() {
            "debug" => Level::Debug,
            "warn" | "warning" => Level::Warn,
            "error" => Level::Error,
            "none" => Level::None,
            _ => Level::Info,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
            Level::None => "none",
        }
    }
}

pub struct Log {
    level: Level,
    /// Set once the config is parsed: where `log.sock` lives. Records are buffered from then on.
    run_dir: Option<PathBuf>,
    buffer: Vec<(Level, String)>,
    /// Labels added to every record (the pod, once known).
    labels: Vec<(String, String)>,
}

impl Default for Log {
    fn default() -> Self {
        Log {
            level: Level::Info,
            run_dir: None,
            buffer: Vec::new(),
            labels: Vec::new(),
        }
    }
}

impl Log {
    pub fn configure(&mut self, level: &str, run_dir: PathBuf) {
        self.level = Level::parse(level);
        self.run_dir = Some(run_dir);
    }

    pub fn label(&mut self, key: &str, value: &str) {
        self.labels.push((key.to_owned(), value.to_owned()));
    }

    pub fn debug(&mut self, msg: &str, kv: &[(&str, &str)]) {
        self.record(Level::Debug, msg, kv);
    }

    pub fn info(&mut self, msg: &str, kv: &[(&str, &str)]) {
        self.record(Level::Info, msg, kv);
    }

    pub fn warn(&mut self, msg: &str, kv: &[(&str, &str)]) {
        self.record(Level::Warn, msg, kv);
    }

    pub fn error(&mut self, msg: &str, kv: &[(&str, &str)]) {
        self.record(Level::Error, msg, kv);
    }

    fn record(&mut self, level: Level, msg: &str, kv: &[(&str, &str)]) {
        if level < self.level || self.level == Level::None {
            return;
        }
        let line = render(SystemTime::now(), level, msg, &self.labels, kv);
        let _ = writeln!(std::io::stderr().lock(), "{line}");
        if self.run_dir.is_some() {
            self.buffer.push((level, line));
        }
    }

    /// Hands the buffered records to the agent, or when it cannot take them, to the node-local
    /// log file; called once, at exit.
    pub fn flush_to_agent(&mut self) {
        let Some(dir) = self.run_dir.clone() else {
            return;
        };
        if self.buffer.is_empty() {
            return;
        }
        let records = std::mem::take(&mut self.buffer);
        if let Err(why) = send_to_agent(&dir, &records) {
            let mut file = RotatingFile::new(dir.join(LOG_FILE), LOG_FILE_ROTATION);
            let note = render(
                SystemTime::now(),
                Level::Warn,
                "agent log socket unavailable; records kept in this file",
                &self.labels,
                &[("reason", &why)],
            );
            let lines = std::iter::once(note.as_str()).chain(
                records
                    .iter()
                    .filter(|(level, _)| *level >= Level::Info)
                    .map(|(_, line)| line.as_str()),
            );
            for line in lines {
                if let Err(e) = file.append(line.as_bytes()) {
                    let _ = writeln!(std::io::stderr().lock(), "istio-cni: {e}");
                    break;
                }
            }
        }
    }
}

fn send_to_agent(dir: &std::path::Path, records: &[(Level, String)]) -> Result<(), String> {
    let socket = dir.join(LOG_SOCKET);
    let lines: Vec<&str> = records.iter().map(|(_, l)| l.as_str()).collect();
    let body = serde_json::to_vec(&lines).expect("in memory");
    let until = Instant::now() + Duration::from_secs(1);
    let stream = UnixStream::connect(&socket).map_err(|e| format!("{}: {e}", socket.display()))?;
    let mut stream = Deadline::new(stream, until);
    let req = Request {
        method: "POST",
        host: "unix",
        path: LOG_PATH,
        headers: &[("Content-Type", "application/json")],
        body: &body,
    };
    match http::exchange(&mut stream, &req, 64 * 1024) {
        Ok(r) if r.status == 200 => Ok(()),
        Ok(r) => Err(format!("{} answered {}", socket.display(), r.status)),
        Err(e) => Err(format!("{}: {e}", socket.display())),
    }
}

fn render(
    now: SystemTime,
    level: Level,
    msg: &str,
    labels: &[(String, String)],
    kv: &[(&str, &str)],
) -> String {
    let mut m = Map::new();
    m.insert(
        "time".into(),
        Value::String(cni_core::cmdadd::log_time(now)),
    );
    m.insert("level".into(), Value::String(level.name().into()));
    m.insert("msg".into(), Value::String(msg.into()));
    for (k, v) in labels {
        m.insert(k.clone(), Value::String(v.clone()));
    }
    for (k, v) in kv {
        m.insert((*k).into(), Value::String((*v).into()));
    }
    // Fixed leading keys make the lines readable; serde_json's map would sort them.
    let mut out = String::from("{");
    for key in ["time", "level", "msg"] {
        let v = m.remove(key).expect("inserted above");
        out.push_str(&format!("{}:{},", Value::String(key.into()), v));
    }
    for (k, v) in m {
        out.push_str(&format!("{}:{},", Value::String(k), v));
    }
    out.pop();
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn records_are_json_with_fixed_leading_keys() {
        let labels = vec![("pod".to_owned(), "default/web-0".to_owned())];
        let line = render(
            UNIX_EPOCH,
            Level::Warn,
            "say \"hi\"",
            &labels,
            &[("reason", "x")],
        );
        assert_eq!(
            line,
            r#"{"time":"1970-01-01T00:00:00.000000Z","level":"warn","msg":"say \"hi\"","pod":"default/web-0","reason":"x"}"#
        );
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["msg"], "say \"hi\"");
    }

    #[test]
    fn levels() {
        assert_eq!(Level::parse("DEBUG"), Level::Debug);
        assert_eq!(Level::parse(""), Level::Info);
        assert_eq!(Level::parse("none"), Level::None);
        let mut log = Log::default();
        log.configure("error", PathBuf::from("/nonexistent"));
        log.info("dropped", &[]);
        log.error("kept", &[]);
        assert_eq!(log.buffer.len(), 1);
        assert!(log.buffer[0].1.contains("\"kept\""));
    }
}
