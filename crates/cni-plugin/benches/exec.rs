//! The plugin as the runtime sees it: wall time of one `istio-cni` exec for a pass-through ADD
//! (process start, config parse, prevResult echoed), and the stripped binary's size.
//! Run: `cargo bench -p cni-plugin --bench exec` (builds the release binary it measures).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RUNS: usize = 300;

fn main() {
    let bin = env!("CARGO_BIN_EXE_istio-cni");
    let conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "bench", "type": "istio-cni",
        "cni_agent_run_dir": "/nonexistent", "ambient_enabled": true,
        "exclude_namespaces": ["kube-system"], "pod_namespace": "istio-system",
        "prevResult": {"cniVersion": "1.0.0",
                       "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
                       "ips": [{"address": "10.0.0.5/24", "interface": 0, "gateway": "10.0.0.1"}]}
    });
    let stdin = serde_json::to_vec(&conf).unwrap();
    let mut times: Vec<Duration> = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let started = Instant::now();
        let mut child = Command::new(bin)
            .env_clear()
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", "0123456789abcdef")
            .env("CNI_NETNS", "/proc/1/ns/net")
            .env("CNI_NETNS_OVERRIDE", "1")
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", "/opt/cni/bin")
            // An excluded namespace: the pass-through path every kube-system pod takes.
            .env(
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-0",
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn istio-cni");
        child.stdin.take().unwrap().write_all(&stdin).unwrap();
        let out = child.wait_with_output().unwrap();
        times.push(started.elapsed());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    times.sort();
    // The same spawn/wait with /bin/true: what any exec costs here, plugin or not.
    let mut floor: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let started = Instant::now();
            let status = Command::new("/bin/true")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(status.success());
            started.elapsed()
        })
        .collect();
    floor.sort();
    let pct = |v: &[Duration], p: f64| {
        v[((v.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1000.0
    };
    let ms = |p: f64| pct(&times, p);
    let size = std::fs::metadata(bin).map(|m| m.len()).unwrap_or(0);
    println!("| measurement | result |");
    println!("|---|---|");
    println!(
        "| pass-through ADD exec, n={RUNS} | median {:.2} ms, p99 {:.2} ms |",
        ms(0.5),
        ms(0.99)
    );
    println!(
        "| `/bin/true` exec with the same harness (floor) | median {:.2} ms, p99 {:.2} ms |",
        pct(&floor, 0.5),
        pct(&floor, 0.99)
    );
    println!(
        "| `istio-cni` binary (bench profile = release, stripped) | {:.2} MiB |",
        size as f64 / 1048576.0
    );
}
