//! Sidecar ADD end to end: one `istio-cni` exec per fresh pod netns, the in-bench agent answering
//! `sidecar` with an injected Pod, until the rules are in place (the plugin returns only after
//! they are). p50/p99 per backend. Needs root.
//! Run: `cargo bench -p cni-plugin --bench sidecar` (`SIDECAR_BENCH_SAMPLES`, default 100).

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dataplane::test_support::TestNetns;
use serde_json::json;

fn agent(dir: &std::path::Path) {
    let pod = json!({
        "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "default",
                     "annotations": {"sidecar.istio.io/status": "{}"}},
        "spec": {"containers": [{"name": "app"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}]}
    });
    let body = json!({"decision": "sidecar", "pod": pod}).to_string();
    let listener = UnixListener::bind(dir.join("pluginevent.sock")).unwrap();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            // One request per connection: read up to the end of the body, answer, close.
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            loop {
                let n = conn.read(&mut chunk).unwrap_or(0);
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf);
                if let Some(end) = text.find("\r\n\r\n") {
                    let len: usize = text[..end]
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse().ok())?
                        })
                        .unwrap_or(0);
                    if buf.len() >= end + 4 + len {
                        break;
                    }
                }
            }
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
}

fn stats(mut v: Vec<Duration>) -> String {
    v.sort();
    let pick = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    format!(
        "p50 {:>6.2} ms  p99 {:>6.2} ms  (n={})",
        pick(0.5).as_secs_f64() * 1e3,
        pick(0.99).as_secs_f64() * 1e3,
        v.len()
    )
}

fn main() {
    if !dataplane::test_support::can_run_privileged() {
        return;
    }
    let samples: usize = std::env::var("SIDECAR_BENCH_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let dir = tempfile::tempdir().unwrap();
    agent(dir.path());
    let bin = env!("CARGO_BIN_EXE_istio-cni");
    for (name, nft) in [("iptables", false), ("nftables", true)] {
        let conf = json!({
            "cniVersion": "1.0.0", "name": "bench", "type": "istio-cni",
            "cni_agent_run_dir": dir.path(), "ambient_enabled": true,
            "pod_namespace": "istio-system", "native_nftables": nft,
            "prevResult": {"cniVersion": "1.0.0",
                           "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
                           "ips": [{"address": "10.0.0.5/24", "interface": 0, "gateway": "10.0.0.1"}]}
        })
        .to_string();
        let mut times = Vec::with_capacity(samples);
        for i in 0..samples {
            let ns = TestNetns::new("bsc");
            let netns = ns.path();
            let start = Instant::now();
            let mut child = Command::new(bin)
                .env_clear()
                .envs([
                    ("CNI_COMMAND", "ADD"),
                    ("CNI_CONTAINERID", "abc"),
                    ("CNI_NETNS", netns.to_str().unwrap()),
                    ("CNI_IFNAME", "eth0"),
                    ("CNI_PATH", "/opt/cni/bin"),
                    ("CNI_ARGS", "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0"),
                    ("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
                ])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            child
                .stdin
                .take()
                .unwrap()
                .write_all(conf.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            times.push(start.elapsed());
            assert!(
                out.status.success(),
                "{name}: ADD failed: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            if i == 0 {
                // The measured path really programs rules.
                let listed = if nft {
                    ns.exec("nft", &["list", "ruleset"])
                } else {
                    let a = ns.exec("iptables-legacy-save", &["-t", "nat"]);
                    a + &ns.exec("iptables-nft-save", &["-t", "nat"])
                };
                assert!(
                    listed.contains("istio-proxy-nat") || listed.contains("ISTIO_REDIRECT"),
                    "{name}: no rules after ADD:\n{listed}"
                );
            }
        }
        println!(
            "sidecar ADD (plugin exec → rules in place), {name:<8}: {}",
            stats(times)
        );
    }
}
