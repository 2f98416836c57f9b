//! `<CNI_AGENT_RUN_DIR>/log.sock`: the plugin's logs, re-emitted through the agent's own logging
//! so they reach the DaemonSet's log stream (kubelet's copy of the plugin's stderr is easy to miss).
//!
//! Wire format (Istio's): `POST /log` with a JSON array of strings, each string one JSON record
//! with `time`, `level` and `msg` (required) and any other keys as labels. Records failing to parse
//! are dropped; the reply is always 200, so a plugin never waits on a bad line.

use std::sync::Mutex;

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use serde_json::{Map, Value};

/// One plugin log record.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginLog {
    pub time: String,
    pub level: String,
    pub msg: String,
    /// Every other key (`scope`, `pod`, ...), rendered as `k=v`.
    pub labels: Map<String, Value>,
}

/// Parses a batch; malformed records (not JSON objects, or without string `time`, `level`, `msg`)
/// are skipped.
pub fn parse_batch(body: &[u8]) -> Vec<PluginLog> {
    let Ok(lines) = serde_json::from_slice::<Vec<String>>(body) else {
        return Vec::new();
    };
    lines
        .iter()
        .filter_map(|line| {
            let Value::Object(mut obj) = serde_json::from_str::<Value>(line).ok()? else {
                return None;
            };
            let mut take = |k: &str| match obj.remove(k) {
                Some(Value::String(s)) => Some(s),
                _ => None,
            };
            let (time, level, msg) = (take("time")?, take("level")?, take("msg")?);
            Some(PluginLog {
                time,
                level,
                msg: msg.trim().to_string(),
                labels: obj,
            })
        })
        .collect()
}

fn labels_text(labels: &Map<String, Value>) -> String {
    labels
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Lines of one batch stay together even when several plugins log at once.
static EMIT: Mutex<()> = Mutex::new(());

fn emit(batch: &[PluginLog]) {
    let _guard = EMIT.lock().unwrap_or_else(|p| p.into_inner());
    for r in batch {
        let labels = labels_text(&r.labels);
        match r.level.as_str() {
            "debug" => {
                tracing::debug!(target: "cni-plugin", plugin_time = %r.time, labels = %labels, "{}", r.msg)
            }
            "info" => {
                tracing::info!(target: "cni-plugin", plugin_time = %r.time, labels = %labels, "{}", r.msg)
            }
            "warn" => {
                tracing::warn!(target: "cni-plugin", plugin_time = %r.time, labels = %labels, "{}", r.msg)
            }
            "error" => {
                tracing::error!(target: "cni-plugin", plugin_time = %r.time, labels = %labels, "{}", r.msg)
            }
            _ => {}
        }
    }
}

pub fn router() -> Router {
    Router::new().route(
        cni_core::cmdadd::LOG_PATH,
        post(|body: Bytes| async move {
            emit(&parse_batch(&body));
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_records_and_drops_bad_ones() {
        let body = serde_json::to_vec(&vec![
            r#"{"time":"2026-11-29T10:00:00.000000Z","level":"info","msg":" added pod ","scope":"cni-plugin","key":2}"#,
            r#"{"time":"2026-11-29T10:00:00.000001Z","level":"warn"}"#,
            "not json",
            r#"["array"]"#,
        ])
        .unwrap();
        let got = parse_batch(&body);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].msg, "added pod");
        assert_eq!(got[0].level, "info");
        assert_eq!(labels_text(&got[0].labels), "key=2 scope=cni-plugin");
        assert!(parse_batch(b"{}").is_empty());
    }
}
