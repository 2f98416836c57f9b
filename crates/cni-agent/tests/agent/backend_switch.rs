//! A backend switch on a live node (our nftables ↔ iptables after a values change, or our agent
//! taking over the iptables rules Istio's agent left in running pods) enrolls each running pod
//! again with the backend now in use, and removes the previous backend's rules. The pod must stay
//! redirected while that happens: a prober inside the pod opens a connection every few hundred
//! microseconds to a witness outside it, and the witness counts every connection that reaches it
//! (redirected, the connection lands on the pod's proxy listener instead). Removing the old rules
//! before programming the new ones left a window with no rules at all, which this catches.

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use cni_agent::ambient::node::{forget_iptables_variant, record_iptables_variant};
use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::consts::OUTBOUND_PORT;
use dataplane::node::{NodeDataplane, NodeOptions};
use dataplane::test_support::{TestNetns, run};

const HOST_IP: &str = "10.79.0.1";
const POD_IP: &str = "10.79.0.2";

/// A `/proc` stand-in with one kubelet (the nftables host rule needs kubelet's UID).
fn fake_proc() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("4242");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("comm"), "kubelet\n").unwrap();
    std::fs::write(dir.join("cmdline"), b"/usr/bin/kubelet\0").unwrap();
    std::fs::write(dir.join("status"), "Name:\tkubelet\nUid:\t0\t0\t0\t0\n").unwrap();
    root
}

/// Accepts on `listener` until `stop`, counting the connections in `count`.
fn count_accepts(
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok(_) => {
                    count.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_micros(100))
                }
                Err(e) => panic!("accept: {e}"),
            }
        }
    })
}

fn dataplane(name: &str, host: &TestNetns, proc_dir: &std::path::Path) -> NodeDataplane {
    let (backend, force_iptables) = match name {
        "nftables" => ("nftables", None),
        "iptables-nft" => ("iptables", Some("nft")),
        "iptables-legacy" => ("iptables", Some("legacy")),
        other => panic!("{other}"),
    };
    NodeDataplane::new(
        host.open(),
        NodeOptions {
            backend,
            force_iptables,
            scoped_xtables_locking: true,
            cfg: InpodConfig::default(),
            proc_dir,
            aws_branch_eni: false,
        },
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn a_backend_switch_keeps_a_running_pod_redirected_throughout() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let (host, pod) = (TestNetns::new("sw-host"), TestNetns::new("sw-pod"));
    let (h, p) = (host.name.as_str(), pod.name.as_str());
    run(
        "ip",
        &[
            "-n", h, "link", "add", "vpod", "type", "veth", "peer", "name", "eth0", "netns", p,
        ],
    );
    run(
        "ip",
        &[
            "-n",
            h,
            "addr",
            "add",
            &format!("{HOST_IP}/24"),
            "dev",
            "vpod",
        ],
    );
    run("ip", &["-n", h, "link", "set", "vpod", "up"]);
    run(
        "ip",
        &[
            "-n",
            p,
            "addr",
            "add",
            &format!("{POD_IP}/24"),
            "dev",
            "eth0",
        ],
    );
    run("ip", &["-n", p, "link", "set", "eth0", "up"]);
    let (host_ns, pod_ns) = (host.open(), pod.open());

    let stop = Arc::new(AtomicBool::new(false));
    let (escaped, proxied, probes) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    // The witness: a closed port's stand-in on the node; a connection here went direct.
    let witness = host_ns
        .run(|| TcpListener::bind((HOST_IP, 9)))
        .unwrap()
        .unwrap();
    // The pod's outbound proxy listener, where redirected connections land.
    let proxy = pod_ns
        .run(|| TcpListener::bind(("0.0.0.0", OUTBOUND_PORT)))
        .unwrap()
        .unwrap();
    let listeners = [
        count_accepts(witness, stop.clone(), escaped.clone()),
        count_accepts(proxy, stop.clone(), proxied.clone()),
    ];

    let proc_dir = fake_proc();
    let names = ["iptables-nft", "nftables", "iptables-legacy"];
    let planes: Vec<NodeDataplane> = names
        .iter()
        .map(|n| dataplane(n, &host, proc_dir.path()))
        .collect();
    let cfg = InpodConfig::default();
    planes[0].enroll(&pod_ns, &cfg).unwrap();

    let prober = {
        let (stop, probes, ns) = (stop.clone(), probes.clone(), pod.open());
        std::thread::spawn(move || {
            ns.run(|| {
                let to: SocketAddr = format!("{HOST_IP}:9").parse().unwrap();
                while !stop.load(Ordering::Relaxed) {
                    let c = TcpStream::connect_timeout(&to, Duration::from_secs(1));
                    probes.fetch_add(1, Ordering::Relaxed);
                    drop(c);
                }
            })
            .unwrap()
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        escaped.load(Ordering::Relaxed),
        0,
        "unredirected before any switch"
    );
    // Every switch between the three, each way round, a few times.
    for _ in 0..3 {
        for i in [1, 2, 0, 2, 1, 0] {
            planes[i]
                .enroll(&pod_ns, &cfg)
                .unwrap_or_else(|e| panic!("to {}: {e}", names[i]));
            assert!(
                !planes[i].leftovers(&pod_ns).unwrap(),
                "{}: the previous backend's rules stayed",
                names[i]
            );
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::Relaxed);
    prober.join().unwrap();
    for l in listeners {
        l.join().unwrap();
    }
    let (probes, escaped, proxied) = (
        probes.load(Ordering::Relaxed),
        escaped.load(Ordering::Relaxed),
        proxied.load(Ordering::Relaxed),
    );
    eprintln!("{probes} probes, {proxied} proxied, {escaped} escaped");
    assert!(proxied > 100, "the prober hardly ran: {probes} probes");
    assert_eq!(
        escaped, 0,
        "{escaped} of {probes} connections escaped redirection during the switches"
    );
}

/// Istio from 1.31.1 reuses the iptables variant named in `<run dir>/detected-iptables-backend-v4`
/// and `-v6` (istio/istio#61024): our iptables backend keeps them naming its own variant, over a
/// stale one an Istio agent left, so Istio's agent on a rollback drives the variant the pods'
/// rules are in; the nftables backend leaves them as they are.
#[test]
fn the_iptables_backend_names_its_variant_where_istio_reads_it() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let host = TestNetns::new("sw-rec");
    let proc_dir = fake_proc();
    let read = |dir: &std::path::Path, family: &str| {
        std::fs::read_to_string(dir.join(format!("detected-iptables-backend-{family}"))).ok()
    };
    for (name, want) in [
        ("iptables-nft", "nft"),
        ("iptables-legacy", "legacy"),
        ("nftables", "stale"),
    ] {
        let run_dir = tempfile::tempdir().unwrap();
        for family in ["v4", "v6"] {
            let file = run_dir
                .path()
                .join(format!("detected-iptables-backend-{family}"));
            std::fs::write(file, "stale").unwrap();
        }
        record_iptables_variant(&dataplane(name, &host, proc_dir.path()), run_dir.path())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for family in ["v4", "v6"] {
            // Istio compares the file's trimmed content with "legacy" and "nft".
            assert_eq!(
                read(run_dir.path(), family).as_deref().map(str::trim),
                Some(want),
                "{name}, {family}"
            );
        }
        // Uninstall takes ours away (nothing of ours left on the node) and leaves another's.
        forget_iptables_variant(&dataplane(name, &host, proc_dir.path()), run_dir.path())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for family in ["v4", "v6"] {
            let left = read(run_dir.path(), family);
            let want_left = (want == "stale").then_some("stale");
            assert_eq!(
                left.as_deref(),
                want_left,
                "{name}, {family} after uninstall"
            );
        }
    }
    // A run dir that cannot be written is an error naming the file.
    let err = record_iptables_variant(
        &dataplane("iptables-nft", &host, proc_dir.path()),
        std::path::Path::new("/nonexistent/run"),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("/nonexistent/run/detected-iptables-backend-v4"),
        "{err}"
    );
}
