//! The primary CNI config as both nodes' churn sees it: another writer that keeps replacing it
//! without our entry, a reader that checks every version it can see, and what counts as damage.
//! Both nodes chain `istio-cni` after the reference `bridge` and `portmap` plugins.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;

/// Our entry's type in the chain.
pub const ISTIO_CNI: &str = "istio-cni";

/// Damage in one read of the conflist named `name`, if any: not JSON, the primary's plugins not
/// first, more than one `istio-cni` entry or one that is not last, the name or version changed.
pub fn damage(text: &str, name: &str) -> Option<String> {
    let v: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Some(format!("not JSON ({e})")),
    };
    let types: Vec<&str> = v["plugins"]
        .as_array()
        .map(|p| p.iter().filter_map(|p| p["type"].as_str()).collect())
        .unwrap_or_default();
    let ours = types.iter().filter(|t| **t == ISTIO_CNI).count();
    let primary_ok = types.starts_with(&["bridge", "portmap"]);
    let ours_ok = ours == 0 || (ours == 1 && types.last() == Some(&ISTIO_CNI));
    let meta_ok = v["name"] == name && v["cniVersion"] == "1.0.0";
    (!(primary_ok && ours_ok && meta_ok && types.len() == 2 + ours)).then(|| {
        format!(
            "plugins {types:?}, name {}, cniVersion {}",
            v["name"], v["cniVersion"]
        )
    })
}

/// The config without our entry, as its own writer (the primary CNI's installer) writes it.
pub fn without_ours(chained: &str) -> Vec<u8> {
    let mut primary: Value = serde_json::from_str(chained).expect("the node's conflist is JSON");
    primary["plugins"]
        .as_array_mut()
        .expect("a conflist has plugins")
        .retain(|p| p["type"] != ISTIO_CNI);
    serde_json::to_vec_pretty(&primary).unwrap()
}

/// Another writer of the primary config, writing its own version without our entry,
/// atomically, in a loop, until stopped or dropped.
pub struct Rewriter {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Rewriter {
    pub fn start(path: PathBuf, primary: Vec<u8>, period: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let tmp = path.with_file_name(format!(".{name}.writer"));
            let mut writes = 0;
            while !s.load(Ordering::Relaxed) {
                if std::fs::write(&tmp, &primary).is_ok() && std::fs::rename(&tmp, &path).is_ok() {
                    writes += 1;
                }
                std::thread::sleep(period);
            }
            writes
        });
        Rewriter {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the writer; returns how many versions it wrote.
    pub fn stop(mut self) -> u64 {
        self.halt()
    }

    fn halt(&mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().unwrap_or(0))
    }
}

impl Drop for Rewriter {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Reads the conflist continuously (every 20 ms) until dropped; every read must pass [`damage`].
pub struct ConflistReader {
    stop: Arc<AtomicBool>,
    reads: Arc<AtomicU64>,
    damaged: Arc<std::sync::Mutex<Vec<String>>>,
}

impl ConflistReader {
    pub fn start(path: PathBuf, name: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(AtomicU64::new(0));
        let damaged = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s, r, d) = (stop.clone(), reads.clone(), damaged.clone());
        let name = name.to_string();
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                // Writers replace the file by rename, so every read sees one whole version.
                if let Ok(text) = std::fs::read_to_string(&path) {
                    r.fetch_add(1, Ordering::Relaxed);
                    if let Some(why) = damage(&text, &name) {
                        d.lock().unwrap().push(format!("damaged CNI config: {why}"));
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        ConflistReader {
            stop,
            reads,
            damaged,
        }
    }

    /// Reads so far, and every damaged version seen.
    pub fn seen(&self) -> (u64, Vec<String>) {
        (
            self.reads.load(Ordering::Relaxed),
            self.damaged.lock().unwrap().clone(),
        )
    }
}

impl Drop for ConflistReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn damaged_configs_are_told_apart_from_chained_and_unchained_ones() {
        let list = |plugins: &str| {
            format!(r#"{{"cniVersion": "1.0.0", "name": "e2e", "plugins": [{plugins}]}}"#)
        };
        let (b, p, i) = (
            r#"{"type": "bridge"}"#,
            r#"{"type": "portmap"}"#,
            r#"{"type": "istio-cni"}"#,
        );
        assert_eq!(damage(&list(&format!("{b},{p}")), "e2e"), None);
        assert_eq!(damage(&list(&format!("{b},{p},{i}")), "e2e"), None);
        assert!(damage(&list(&format!("{b},{p}")), "real-node").is_some());
        for bad in [
            list(&format!("{b},{p},{i},{i}")),
            list(&format!("{b},{i},{p}")),
            list(b),
            list(&format!("{b},{p}")).replace("e2e", "other"),
            list(&format!("{b},{p}"))[..20].to_string(),
        ] {
            assert!(damage(&bad, "e2e").is_some(), "{bad}");
        }
    }

    #[test]
    fn the_other_writers_version_has_no_istio_cni_and_keeps_the_rest() {
        let chained = r#"{"cniVersion": "1.0.0", "name": "e2e",
            "plugins": [{"type": "bridge"}, {"type": "portmap"}, {"type": "istio-cni"}]}"#;
        let text = String::from_utf8(without_ours(chained)).unwrap();
        assert_eq!(damage(&text, "e2e"), None);
        assert!(!text.contains(ISTIO_CNI), "{text}");
    }
}
