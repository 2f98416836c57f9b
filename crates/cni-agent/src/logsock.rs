//! `<CNI_AGENT_RUN_DIR>/log.sock`: the plugin's logs, re-emitted through the agent's own logging
//! so they reach the DaemonSet's log stream (kubelet's copy of the plugin's stderr is easy to miss),
//! as scope `cni-plugin` with the plugin's own time (see [`crate::logging::emit_plugin_record`]).
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
    /// Every other key (`pod`, ...): the record's labels.
    pub labels: Map<String, Value>,
}

/// Parses a batch; malformed records (not JSON objects, or without string `time`, `level`, `msg`)
/// are skipped with a debug record, a malformed batch with an error record, as Istio's agent does.
pub fn parse_batch(body: &[u8]) -> Vec<PluginLog> {
    let lines = match serde_json::from_slice::<Vec<String>>(body) {
        Ok(lines) => lines,
        Err(e) => {
            tracing::error!("Failed to unmarshal CNI plugin logs: {e}");
            return Vec::new();
        }
    };
    lines
        .iter()
        .filter_map(|line| match parse_record(line) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::debug!("Failed to unmarshal CNI plugin log entry: {e}");
                None
            }
        })
        .collect()
}

fn parse_record(line: &str) -> Result<PluginLog, String> {
    let Value::Object(mut obj) = serde_json::from_str::<Value>(line).map_err(|e| e.to_string())?
    else {
        return Err("not a JSON object".into());
    };
    let mut take = |k: &str| match obj.remove(k) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(format!("no string {k:?}")),
    };
    let (time, level, msg) = (take("time")?, take("level")?, take("msg")?);
    Ok(PluginLog {
        time,
        level,
        msg: msg.trim().to_string(),
        labels: obj,
    })
}

/// Lines of one batch stay together even when several plugins log at once.
static EMIT: Mutex<()> = Mutex::new(());

/// Re-emits a batch as scope `cni-plugin`, filtered by that scope's level.
pub fn emit(batch: &[PluginLog]) {
    let _guard = EMIT.lock().unwrap_or_else(|p| p.into_inner());
    for r in batch {
        let labels: Vec<(String, Value)> = r
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        crate::logging::emit_plugin_record(&r.level, &r.time, &r.msg, &labels);
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
        assert_eq!(
            Value::Object(got[0].labels.clone()),
            serde_json::json!({"key": 2, "scope": "cni-plugin"})
        );
        assert!(parse_batch(b"{}").is_empty());
    }
}
