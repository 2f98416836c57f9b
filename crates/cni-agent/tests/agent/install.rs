//! Istio's installer cases (cni/pkg/install and cni/test/install_k8s_test.go, rewritten from their
//! description) against temp dirs: the library in-process, and the `install-cni` binary end to end
//! (`install --once`, `uninstall`, and the run loop repairing what other programs do to the config).

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cni_agent::cli::Cli;
use cni_agent::config::parse_from;
use cni_agent::install::Installer;
use cni_agent::install::config::InstallConfig;
use serde_json::Value;

const TESTDATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/testdata/install");
const BIN: &str = env!("CARGO_BIN_EXE_install-cni");

fn fixture(path: &str) -> String {
    std::fs::read_to_string(Path::new(TESTDATA).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

/// A fake node: conf dir, bin dir, image bin dir, agent run dir and service account dir.
struct Node {
    _root: tempfile::TempDir,
    conf: PathBuf,
    bin: PathBuf,
    src: PathBuf,
    run: PathBuf,
    sa: PathBuf,
}

impl Node {
    fn new() -> Node {
        let root = tempfile::tempdir().unwrap();
        let p = |n: &str| root.path().join(n);
        let node = Node {
            conf: p("net.d"),
            bin: p("opt-cni-bin"),
            src: p("image-bin"),
            run: p("run"),
            sa: p("sa"),
            _root: root,
        };
        for d in [&node.conf, &node.bin, &node.src, &node.sa] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(node.sa.join("token"), "service_account_token_string").unwrap();
        std::fs::write(node.sa.join("ca.crt"), "fake-ca").unwrap();
        std::fs::write(node.src.join("istio-cni"), "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(
            node.src.join("istio-cni"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        node
    }

    fn env(&self, extra: &[(&str, &str)]) -> HashMap<String, String> {
        let mut env: HashMap<String, String> = [
            ("MOUNTED_CNI_NET_DIR", self.conf.to_str().unwrap()),
            ("CNI_BIN_DIR", self.bin.to_str().unwrap()),
            ("CNI_BIN_SOURCE_DIR", self.src.to_str().unwrap()),
            ("CNI_AGENT_RUN_DIR", self.run.to_str().unwrap()),
            ("SERVICE_ACCOUNT_DIR", self.sa.to_str().unwrap()),
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("EXCLUDE_NAMESPACES", "istio-system"),
            ("POD_NAMESPACE", "istio-system"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    }

    fn config(&self, extra: &[(&str, &str)]) -> InstallConfig {
        let cli: Cli = parse_from(
            ["install-cni", "--log_output_level=all:debug"],
            &self.env(extra),
        )
        .unwrap();
        InstallConfig::from_args(&cli.install, &cli.log).unwrap()
    }

    fn command(&self, args: &[&str], extra: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.env_clear()
            .envs(self.env(extra))
            .arg("--log_output_level=all:debug")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Runs `install-cni <args>` to completion; returns stdout, panicking with stderr on failure.
    fn run(&self, args: &[&str], extra: &[(&str, &str)]) -> String {
        let out = self.command(args, extra).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "install-cni {args:?} failed: {}\n{stderr}",
            out.status
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn put(&self, name: &str, content: &str) {
        std::fs::write(self.conf.join(name), content).unwrap();
    }

    /// Writes like a well-behaved CNI does (temp file + rename), so no half-written file is seen.
    fn put_atomic(&self, name: &str, content: &str) {
        let tmp = self.conf.join(format!(".{name}.partial"));
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(tmp, self.conf.join(name)).unwrap();
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.conf.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    fn conf_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.conf)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    /// An expected fixture with the run dir filled in.
    fn expected(&self, name: &str) -> Value {
        json(&fixture(&format!("expected/{name}")).replace("@RUN_DIR@", self.run.to_str().unwrap()))
    }

    fn entry(&self) -> Value {
        self.expected("istio-entry.json")
    }
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}

fn has_entry(text: &str) -> bool {
    serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| v["plugins"].as_array().cloned())
        .is_some_and(|p| p.iter().any(|e| e["type"] == "istio-cni"))
}

// ---- in-process: Istio's TestCreateCNIConfigFile cases ------------------------------------------

fn unit_node(files: &[(&str, &str)]) -> Node {
    let node = Node::new();
    for (name, fixture_name) in files {
        node.put(name, &fixture(&format!("unit/{fixture_name}")));
    }
    node
}

fn bridge_golden(node: &Node) -> Value {
    let mut bridge = json(&fixture("unit/bridge.conf"));
    bridge.as_object_mut().unwrap().remove("cniVersion");
    serde_json::json!({"cniVersion": "0.3.1", "name": "k8s-pod-network", "plugins": [bridge, node.entry()]})
}

fn list_golden(node: &Node) -> Value {
    let mut list = json(&fixture("unit/list.conflist"));
    list["plugins"].as_array_mut().unwrap().push(node.entry());
    list
}

/// One install pass; `None` when it is still waiting for a primary after `wait`.
async fn install_within(node: &Node, extra: &[(&str, &str)], wait: Duration) -> Option<PathBuf> {
    let mut installer = Installer::new(node.config(extra));
    tokio::time::timeout(wait, installer.install_all())
        .await
        .ok()
        .map(|r| r.unwrap())
}

async fn install(node: &Node, extra: &[(&str, &str)]) -> Option<PathBuf> {
    install_within(node, extra, Duration::from_secs(20)).await
}

async fn install_waits(node: &Node, extra: &[(&str, &str)]) -> bool {
    install_within(node, extra, Duration::from_millis(300))
        .await
        .is_none()
}

#[tokio::test]
async fn create_cni_config_file_cases() {
    dataplane::enter_test_group!();
    let both = [
        ("bridge.conf", "bridge.conf"),
        ("list.conflist", "list.conflist"),
    ];

    // Unspecified: the first file (bridge.conf) is wrapped and becomes bridge.conflist.
    let node = unit_node(&both);
    let path = install(&node, &[]).await.unwrap();
    assert_eq!(path, node.conf.join("bridge.conflist"));
    assert_eq!(json(&node.read("bridge.conflist")), bridge_golden(&node));
    assert_eq!(node.conf_files(), ["bridge.conflist", "list.conflist"]);

    // Unspecified, nothing ever created: waits (times out), writes nothing.
    let node = unit_node(&[]);
    assert!(install_waits(&node, &[]).await);
    assert!(node.conf_files().is_empty());

    // Specified existing / specified with the other extension.
    for (name, want) in [
        ("list.conflist", "list.conflist"),
        ("list.conf", "list.conflist"),
    ] {
        let node = unit_node(&both);
        let path = install(&node, &[("CNI_CONF_NAME", name)]).await.unwrap();
        assert_eq!(path, node.conf.join(want));
        assert_eq!(json(&node.read(want)), list_golden(&node));
        assert_eq!(
            json(&node.read("bridge.conf")),
            json(&fixture("unit/bridge.conf"))
        );
    }
    let node = unit_node(&both);
    let path = install(&node, &[("CNI_CONF_NAME", "bridge.conflist")])
        .await
        .unwrap();
    assert_eq!(path, node.conf.join("bridge.conflist"));
    assert_eq!(json(&node.read("bridge.conflist")), bridge_golden(&node));

    // Specified but never created: waits.
    let node = unit_node(&both);
    assert_eq!(
        install(&node, &[("CNI_CONF_NAME", "never-created.conf")]).await,
        None
    );

    // Any extension is accepted when named explicitly.
    let node = unit_node(&[
        ("bridge.conf", "bridge.conf"),
        ("undetectable.file", "list.conflist"),
    ]);
    let path = install(&node, &[("CNI_CONF_NAME", "undetectable.file")])
        .await
        .unwrap();
    assert_eq!(path, node.conf.join("undetectable.file"));
    assert_eq!(json(&node.read("undetectable.file")), list_golden(&node));

    // Standalone, default and specified names.
    for (name, want) in [
        ("", "YYY-istio-cni.conf"),
        ("specific-name.conf", "specific-name.conf"),
    ] {
        let node = unit_node(&[]);
        let path = install(
            &node,
            &[("CHAINED_CNI_PLUGIN", "false"), ("CNI_CONF_NAME", name)],
        )
        .await
        .unwrap();
        assert_eq!(path, node.conf.join(want));
        assert_eq!(json(&node.read(want)), node.expected("YYY-istio-cni.conf"));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}

#[tokio::test]
async fn istio_owned_cases() {
    dataplane::enter_test_group!();
    let owned = |primary: &'static str| {
        [
            ("AMBIENT_ENABLED", "true"),
            ("ISTIO_OWNED_CNI_CONFIG", "true"),
            ("ISTIO_OWNED_CNI_CONFIG_FILENAME", "02-istio-conf.conflist"),
            ("CNI_CONF_NAME", primary),
        ]
    };
    let with_ambient = |mut v: Value| {
        let last = v["plugins"].as_array_mut().unwrap().last_mut().unwrap();
        last["ambient_enabled"] = Value::Bool(true);
        v
    };
    let both = [
        ("bridge.conf", "bridge.conf"),
        ("list.conflist", "list.conflist"),
    ];
    let node = unit_node(&both);
    let path = install(&node, &owned("bridge.conflist")).await.unwrap();
    assert_eq!(path, node.conf.join("02-istio-conf.conflist"));
    assert_eq!(
        json(&node.read("02-istio-conf.conflist")),
        with_ambient(bridge_golden(&node))
    );
    // The primary is never touched in owned mode.
    assert_eq!(node.read("bridge.conf"), fixture("unit/bridge.conf"));

    for primary in ["list.conflist", "list.conf"] {
        let node = unit_node(&both);
        install(&node, &owned(primary)).await.unwrap();
        assert_eq!(
            json(&node.read("02-istio-conf.conflist")),
            with_ambient(list_golden(&node))
        );
        assert_eq!(node.read("list.conflist"), fixture("unit/list.conflist"));
    }
    let node = unit_node(&both);
    assert!(install_waits(&node, &owned("never-created.conflist")).await);

    let node = unit_node(&[
        ("bridge.conf", "bridge.conf"),
        ("undetectable.file", "list.conflist"),
    ]);
    install(&node, &owned("undetectable.file")).await.unwrap();
    assert_eq!(
        json(&node.read("02-istio-conf.conflist")),
        with_ambient(list_golden(&node))
    );

    // The Helm chart's key (which Istio's agent ignores) names the owned file too.
    let node = unit_node(&both);
    let helm = [
        ("AMBIENT_ENABLED", "true"),
        ("ISTIO_OWNED_CNI_CONFIG", "true"),
        ("ISTIO_OWNED_CNI_CONF_FILENAME", "01-helm-owned.conflist"),
    ];
    let path = install(&node, &helm).await.unwrap();
    assert_eq!(path, node.conf.join("01-helm-owned.conflist"));
    // Without CNI_CONF_NAME the primary is the best config other than ours.
    assert_eq!(
        json(&node.read("01-helm-owned.conflist")),
        with_ambient(bridge_golden(&node))
    );
}

#[tokio::test]
async fn check_accepts_what_it_wrote_and_rejects_tampering() {
    dataplane::enter_test_group!();
    let node = unit_node(&[("list.conflist", "list.conflist")]);
    let mut installer = Installer::new(node.config(&[]));
    installer.install_all().await.unwrap();
    installer.check().unwrap();
    // Our entry edited by someone else.
    let edited = node.read("list.conflist").replace(
        "\"pod_namespace\": \"istio-system\"",
        "\"pod_namespace\": \"x\"",
    );
    node.put("list.conflist", &edited);
    assert!(installer.check().unwrap_err().contains("differs"));
    // Our entry removed.
    node.put("list.conflist", &fixture("unit/list.conflist"));
    assert!(installer.check().unwrap_err().contains("removed"));
    // File removed.
    std::fs::remove_file(node.conf.join("list.conflist")).unwrap();
    assert!(installer.check().is_err());

    // Intentionally preempted (CNI_CONF_NAME set): only a warning.
    let node = unit_node(&[("list.conflist", "list.conflist")]);
    let mut installer = Installer::new(node.config(&[("CNI_CONF_NAME", "list.conflist")]));
    installer.install_all().await.unwrap();
    node.put("bridge.conf", &fixture("unit/bridge.conf"));
    installer.check().unwrap();

    // Standalone: someone else's config under our name is not ours.
    let node = unit_node(&[]);
    let mut installer = Installer::new(node.config(&[("CHAINED_CNI_PLUGIN", "false")]));
    installer.install_all().await.unwrap();
    installer.check().unwrap();
    node.put("YYY-istio-cni.conf", &fixture("unit/bridge.conf"));
    assert!(installer.check().unwrap_err().contains("modified"));
}

// ---- the binary: Istio's install_k8s_test cases -------------------------------------------------

struct K8sCase {
    name: &'static str,
    pre: &'static [&'static str],
    conf_name: Option<&'static str>,
    result: &'static str,
    expected: &'static str,
    clean: &'static str,
}

const CALICO_EXPECTED: &str = "calico.conflist-istioconfig";
const MINIKUBE_EXPECTED: &str = "minikube_cni.conflist.expected";
const CALICO_CLEAN: &str = "pre/calico.conflist";
const MINIKUBE_CLEAN: &str = "expected/minikube_cni.conflist.clean";

const K8S_CASES: &[K8sCase] = &[
    K8sCase {
        name: "pre-plugins .conflist",
        pre: &["calico.conflist"],
        conf_name: Some("00-calico.conflist"),
        result: "00-calico.conflist",
        expected: CALICO_EXPECTED,
        clean: CALICO_CLEAN,
    },
    K8sCase {
        name: "no pre-plugins .conf",
        pre: &["minikube_cni.conf"],
        conf_name: Some("00-minikube_cni.conf"),
        result: "00-minikube_cni.conflist",
        expected: MINIKUBE_EXPECTED,
        clean: MINIKUBE_CLEAN,
    },
    K8sCase {
        name: "first file .conflist",
        pre: &["calico.conflist", "minikube_cni.conf"],
        conf_name: None,
        result: "00-calico.conflist",
        expected: CALICO_EXPECTED,
        clean: CALICO_CLEAN,
    },
    K8sCase {
        name: "first file .conf",
        pre: &["minikube_cni.conf", "calico.conflist"],
        conf_name: None,
        result: "00-minikube_cni.conflist",
        expected: MINIKUBE_EXPECTED,
        clean: MINIKUBE_CLEAN,
    },
    K8sCase {
        name: "skip non-json .conf",
        pre: &["non_json.conf", "minikube_cni.conf", "calico.conflist"],
        conf_name: None,
        result: "01-minikube_cni.conflist",
        expected: MINIKUBE_EXPECTED,
        clean: MINIKUBE_CLEAN,
    },
    K8sCase {
        name: "skip non-json .conflist",
        pre: &["non_json.conflist", "calico.conflist", "minikube_cni.conf"],
        conf_name: None,
        result: "01-calico.conflist",
        expected: CALICO_EXPECTED,
        clean: CALICO_CLEAN,
    },
    K8sCase {
        name: "skip .conf without type",
        pre: &[
            "bad_minikube_cni.conf",
            "minikube_cni.conf",
            "calico.conflist",
        ],
        conf_name: None,
        result: "01-minikube_cni.conflist",
        expected: MINIKUBE_EXPECTED,
        clean: MINIKUBE_CLEAN,
    },
    K8sCase {
        name: "skip .conf without type, then list",
        pre: &[
            "bad_minikube_cni.conf",
            "calico.conflist",
            "minikube_cni.conf",
        ],
        conf_name: None,
        result: "01-calico.conflist",
        expected: CALICO_EXPECTED,
        clean: CALICO_CLEAN,
    },
    K8sCase {
        name: "skip nameless and pugins lists, .conf",
        pre: &[
            "noname_calico.conflist",
            "noplugins_calico.conflist",
            "minikube_cni.conf",
            "calico.conflist",
        ],
        conf_name: None,
        result: "02-minikube_cni.conflist",
        expected: MINIKUBE_EXPECTED,
        clean: MINIKUBE_CLEAN,
    },
    K8sCase {
        name: "skip nameless and pugins lists, .conflist",
        pre: &[
            "noname_calico.conflist",
            "noplugins_calico.conflist",
            "calico.conflist",
            "minikube_cni.conf",
        ],
        conf_name: None,
        result: "02-calico.conflist",
        expected: CALICO_EXPECTED,
        clean: CALICO_CLEAN,
    },
    K8sCase {
        name: "named .conf missing, .conflist exists",
        pre: &["calico.conflist"],
        conf_name: Some("00-calico.conf"),
        result: "00-calico.conflist",
        expected: CALICO_EXPECTED,
        clean: CALICO_CLEAN,
    },
    K8sCase {
        name: "named .conflist missing, .conf exists",
        pre: &["minikube_cni.conf"],
        conf_name: Some("00-minikube_cni.conflist"),
        result: "00-minikube_cni.conflist",
        expected: MINIKUBE_EXPECTED,
        clean: MINIKUBE_CLEAN,
    },
];

#[test]
fn k8s_install_then_uninstall_cases() {
    dataplane::enter_test_group!();
    for case in K8S_CASES {
        let node = Node::new();
        let mut originals = HashMap::new();
        for (i, pre) in case.pre.iter().enumerate() {
            let name = format!("0{i}-{pre}");
            let content = fixture(&format!("pre/{pre}"));
            node.put(&name, &content);
            originals.insert(name, content);
        }
        let extra: Vec<(&str, &str)> = case
            .conf_name
            .iter()
            .map(|n| ("CNI_CONF_NAME", *n))
            .collect();
        let stdout = node.run(&["install", "--once"], &extra);
        assert_eq!(
            stdout.trim(),
            node.conf.join(case.result).to_str().unwrap(),
            "{}",
            case.name
        );
        assert_eq!(
            json(&node.read(case.result)),
            node.expected(case.expected),
            "{}",
            case.name
        );
        assert_eq!(
            std::fs::read(node.bin.join("istio-cni")).unwrap(),
            std::fs::read(node.src.join("istio-cni")).unwrap()
        );
        assert!(node.run.join("istio-cni-kubeconfig").exists());
        // Every other file (including the invalid ones) is byte-for-byte untouched.
        for (name, content) in &originals {
            if name != case.result && !case.result.starts_with(name.trim_end_matches(".conf")) {
                assert_eq!(&node.read(name), content, "{}: {name} changed", case.name);
            }
        }
        assert!(
            !node.conf_files().iter().any(|n| n.contains(".tmp")),
            "{}",
            case.name
        );

        node.run(&["uninstall"], &extra);
        let clean = fixture(case.clean);
        if case.clean == CALICO_CLEAN {
            // Our splice removes exactly what it added.
            assert_eq!(node.read(case.result), clean, "{}", case.name);
        } else {
            assert_eq!(json(&node.read(case.result)), json(&clean), "{}", case.name);
        }
        assert!(!node.bin.join("istio-cni").exists(), "{}", case.name);
        assert!(
            !node.run.join("istio-cni-kubeconfig").exists(),
            "{}",
            case.name
        );
    }
}

#[test]
fn delayed_primary_is_picked_up() {
    dataplane::enter_test_group!();
    for (conf_name, written_as, result) in [
        (
            Some("missing_initially.conf"),
            "missing_initially.conf",
            "missing_initially.conflist",
        ),
        (None, "calico.conflist", "calico.conflist"),
    ] {
        let node = Node::new();
        let extra: Vec<(&str, &str)> = conf_name.iter().map(|n| ("CNI_CONF_NAME", *n)).collect();
        // Another, unrelated config must not be chosen when a name is configured.
        if conf_name.is_some() {
            node.put("00-other.conflist", &fixture("pre/calico.conflist"));
        }
        let child = node
            .command(&["install", "--once"], &extra)
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(500));
        assert!(!node.conf.join(result).exists());
        node.put_atomic(written_as, &fixture("pre/calico.conflist"));
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8(out.stdout).unwrap().trim(),
            node.conf.join(result).to_str().unwrap()
        );
        assert_eq!(json(&node.read(result)), node.expected(CALICO_EXPECTED));
        if conf_name.is_some() {
            assert_eq!(
                node.read("00-other.conflist"),
                fixture("pre/calico.conflist")
            );
        }
    }
}

#[test]
fn standalone_install_and_uninstall() {
    dataplane::enter_test_group!();
    for (conf_name, file) in [
        ("", "YYY-istio-cni.conf"),
        ("user-defined.conf", "user-defined.conf"),
    ] {
        let node = Node::new();
        let extra = [
            ("CHAINED_CNI_PLUGIN", "false"),
            ("CNI_CONF_NAME", conf_name),
        ];
        node.run(&["install", "--once"], &extra);
        assert_eq!(json(&node.read(file)), node.expected("YYY-istio-cni.conf"));
        node.run(&["uninstall"], &extra);
        assert!(node.conf_files().is_empty(), "{:?}", node.conf_files());
    }
}

#[test]
fn symlinks_and_unparseable_files_are_left_alone() {
    dataplane::enter_test_group!();
    let node = Node::new();
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("calico.conflist");
    std::fs::write(&target, fixture("pre/calico.conflist")).unwrap();
    std::os::unix::fs::symlink(&target, node.conf.join("00-evil.conflist")).unwrap();
    let garbage = "{\"name\": \"half\", \"plugins\": [{\"type\": \"istio-cni\"}\n";
    node.put("01-broken.conflist", garbage);
    node.put("10-calico.conflist", &fixture("pre/calico.conflist"));

    let stdout = node.run(&["install", "--once"], &[]);
    assert_eq!(
        stdout.trim(),
        node.conf.join("10-calico.conflist").to_str().unwrap()
    );
    node.run(&["uninstall"], &[]);
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        fixture("pre/calico.conflist")
    );
    assert!(node.conf.join("00-evil.conflist").is_symlink());
    assert_eq!(node.read("01-broken.conflist"), garbage);
    assert_eq!(
        node.read("10-calico.conflist"),
        fixture("pre/calico.conflist")
    );
}

#[test]
fn owned_mode_end_to_end_keeps_the_primary_intact() {
    dataplane::enter_test_group!();
    let node = Node::new();
    node.put("10-calico.conflist", &fixture("pre/calico.conflist"));
    let extra = [
        ("AMBIENT_ENABLED", "true"),
        ("ISTIO_OWNED_CNI_CONFIG", "true"),
        ("ISTIO_OWNED_CNI_CONF_FILENAME", "01-istio-owned.conflist"),
    ];
    let stdout = node.run(&["install", "--once"], &extra);
    assert_eq!(
        stdout.trim(),
        node.conf.join("01-istio-owned.conflist").to_str().unwrap()
    );
    let owned = json(&node.read("01-istio-owned.conflist"));
    assert_eq!(owned["plugins"].as_array().unwrap().len(), 3);
    assert_eq!(owned["plugins"][2]["ambient_enabled"], Value::Bool(true));
    assert_eq!(
        node.read("10-calico.conflist"),
        fixture("pre/calico.conflist")
    );
    node.run(&["uninstall"], &extra);
    assert_eq!(node.conf_files(), ["10-calico.conflist"]);
    assert_eq!(
        node.read("10-calico.conflist"),
        fixture("pre/calico.conflist")
    );
}

#[test]
fn version_and_bad_config_exit_codes() {
    dataplane::enter_test_group!();
    let node = Node::new();
    assert!(node.run(&["version"], &[]).starts_with("install-cni "));
    let out = node
        .command(&["install", "--once"], &[("KUBECONFIG_MODE", "600")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("kubeconfig-mode"));
}

// ---- the run loop -------------------------------------------------------------------------------

/// The agent process, stopped with SIGTERM on drop if the test did not stop it.
struct Agent(Option<Child>);

impl Agent {
    fn terminate(&mut self) -> (std::process::ExitStatus, String) {
        let mut child = self.0.take().unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = child.wait().unwrap();
        // Empty when the test sent stderr to a file of its own.
        let mut stderr = String::new();
        if let Some(mut e) = child.stderr.take() {
            e.read_to_string(&mut stderr).unwrap();
        }
        (status, stderr)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn run_loop_repairs_follows_and_cleans_up() {
    dataplane::enter_test_group!();
    let node = Node::new();
    let calico = fixture("pre/calico.conflist");
    node.put("10-calico.conflist", &calico);
    let garbage = "not json at all {";
    node.put("05-garbage.conflist", garbage);
    let mut agent = Agent(Some(
        node.command(&[], &[])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let limit = Duration::from_secs(5);

    wait_until("initial install", limit, || {
        has_entry(&node.read("10-calico.conflist"))
    });
    assert_eq!(
        json(&node.read("10-calico.conflist")),
        node.expected(CALICO_EXPECTED)
    );

    // Another CNI rewrites its config without our entry: repaired.
    std::thread::sleep(Duration::from_millis(200));
    node.put("10-calico.conflist", &calico);
    let took = wait_until("repair after rewrite", limit, || {
        has_entry(&node.read("10-calico.conflist"))
    });
    eprintln!("repaired a rewritten config in {took:?}");

    // Our entry tampered with: replaced with ours.
    let tampered = node.read("10-calico.conflist").replace(
        "\"plugin_log_level\": \"debug\"",
        "\"plugin_log_level\": \"none\"",
    );
    node.put("10-calico.conflist", &tampered);
    wait_until("repair after tampering", limit, || {
        node.read("10-calico.conflist")
            .contains("\"plugin_log_level\": \"debug\"")
    });

    // A higher-priority primary appears: followed, and the old one gives up our entry.
    node.put(
        "00-newcni.conflist",
        &fixture("pre/calico.conflist").replace("calico", "newcni"),
    );
    let took = wait_until("following a new primary", limit, || {
        has_entry(&node.read("00-newcni.conflist")) && !has_entry(&node.read("10-calico.conflist"))
    });
    eprintln!("followed a new higher-priority primary in {took:?}");
    assert_eq!(node.read("10-calico.conflist"), calico);

    // The plugin binary deleted: copied again.
    std::fs::remove_file(node.bin.join("istio-cni")).unwrap();
    wait_until("binary restored", limit, || {
        node.bin.join("istio-cni").exists()
    });

    // The new primary goes away again: back to calico.
    std::fs::remove_file(node.conf.join("00-newcni.conflist")).unwrap();
    wait_until("back to the old primary", limit, || {
        has_entry(&node.read("10-calico.conflist"))
    });

    assert_eq!(node.read("05-garbage.conflist"), garbage);
    assert!(
        !node.conf_files().iter().any(|n| n.contains(".tmp")),
        "{:?}",
        node.conf_files()
    );

    let (status, stderr) = agent.terminate();
    assert!(status.success(), "{status}\n{stderr}");
    assert_eq!(
        node.read("10-calico.conflist"),
        calico,
        "cleanup restores the primary byte for byte"
    );
    assert_eq!(node.read("05-garbage.conflist"), garbage);
    assert!(!node.bin.join("istio-cni").exists());
    assert!(!node.run.join("istio-cni-kubeconfig").exists());
}

/// A primary the installer does not recognise (JSON, but `plugins` is no list) is named at start
/// with the file it read, never chained into, and nothing half-written appears beside it; the
/// installer keeps waiting, and chains the first valid primary that shows up.
#[test]
fn run_loop_names_an_unrecognised_primary_and_never_chains_into_it() {
    dataplane::enter_test_group!();
    let node = Node::new();
    let vendor = r#"{"cniVersion": "1.0.0", "name": "vendor", "plugins": {"type": "vendor"}}"#;
    node.put("10-vendor.conflist", vendor);
    let log_path = node.conf.parent().unwrap().join("agent.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut agent = Agent(Some(node.command(&[], &[]).stderr(log).spawn().unwrap()));
    let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let limit = Duration::from_secs(10);

    wait_until("the installer waiting for a primary", limit, || {
        read_log().contains("waiting for the primary CNI config")
    });
    let named = format!(
        "skipping invalid CNI config {}",
        node.conf.join("10-vendor.conflist").display()
    );
    assert!(read_log().contains(&named), "{}", read_log());
    assert_eq!(node.conf_files(), ["10-vendor.conflist"]);
    assert_eq!(node.read("10-vendor.conflist"), vendor);

    // A valid primary after it in priority: chained, the unrecognised one still as it was.
    let calico = fixture("pre/calico.conflist");
    node.put_atomic("20-calico.conflist", &calico);
    wait_until("chained into the valid primary", limit, || {
        has_entry(&node.read("20-calico.conflist"))
    });
    assert_eq!(node.read("10-vendor.conflist"), vendor);
    assert_eq!(
        node.conf_files(),
        ["10-vendor.conflist", "20-calico.conflist"]
    );

    let (status, _) = agent.terminate();
    assert!(status.success(), "{status}\n{}", read_log());
    assert_eq!(node.read("20-calico.conflist"), calico);
    assert_eq!(node.read("10-vendor.conflist"), vendor);
}

#[test]
fn run_loop_standalone_file_removed_is_rewritten() {
    dataplane::enter_test_group!();
    let node = Node::new();
    let extra = [("CHAINED_CNI_PLUGIN", "false")];
    let mut agent = Agent(Some(
        node.command(&[], &extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let file = node.conf.join("YYY-istio-cni.conf");
    wait_until("standalone file", Duration::from_secs(5), || file.exists());
    std::thread::sleep(Duration::from_millis(200));
    std::fs::remove_file(&file).unwrap();
    let took = wait_until("standalone file rewritten", Duration::from_secs(5), || {
        file.exists()
    });
    eprintln!("rewrote a removed standalone config in {took:?}");
    let (status, stderr) = agent.terminate();
    assert!(status.success(), "{stderr}");
    assert!(node.conf_files().is_empty(), "{:?}", node.conf_files());
}

#[test]
fn owned_flag_without_ambient_edits_in_place_and_cleanup_keeps_the_primary() {
    dataplane::enter_test_group!();
    // Istio deleted the primary here (its cleanup looked at the raw flag).
    let node = Node::new();
    node.put("10-calico.conflist", &fixture("pre/calico.conflist"));
    let extra = [("ISTIO_OWNED_CNI_CONFIG", "true")];
    let stdout = node.run(&["install", "--once"], &extra);
    assert_eq!(
        stdout.trim(),
        node.conf.join("10-calico.conflist").to_str().unwrap()
    );
    node.run(&["uninstall"], &extra);
    assert_eq!(
        node.read("10-calico.conflist"),
        fixture("pre/calico.conflist")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_watch_loop_and_token_rotation_refreshes_kubeconfig() {
    dataplane::enter_test_group!();
    let node = Node::new();
    node.put("10-calico.conflist", &fixture("pre/calico.conflist"));
    let mut installer = Installer::new(node.config(&[]));
    let mut ready = installer.readiness();
    assert!(!*ready.borrow());
    let task = tokio::spawn(async move { installer.run().await });
    let limit = Duration::from_secs(10);
    tokio::time::timeout(limit, ready.wait_for(|r| *r))
        .await
        .unwrap()
        .unwrap();

    // Token rotation: the loop yields (not ready), rewrites the kubeconfig, becomes ready again.
    std::fs::write(node.sa.join("token"), "rotated_token").unwrap();
    tokio::time::timeout(limit, ready.wait_for(|r| !*r))
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(limit, ready.wait_for(|r| *r))
        .await
        .unwrap()
        .unwrap();
    let kc = std::fs::read_to_string(node.run.join("istio-cni-kubeconfig")).unwrap();
    assert!(kc.contains("token: rotated_token\n"), "{kc}");

    // An invalid config keeps it not ready; the repair brings it back.
    node.put("10-calico.conflist", &fixture("pre/calico.conflist"));
    tokio::time::timeout(limit, ready.wait_for(|r| !*r))
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(limit, ready.wait_for(|r| *r))
        .await
        .unwrap()
        .unwrap();
    assert!(has_entry(&node.read("10-calico.conflist")));

    assert!(
        !task.is_finished(),
        "the loop only ends on error or cancellation"
    );
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
}

/// `istio_cni_installs_total{result}` counts each failing step under Istio's label, and a verified
/// installation as `SUCCESS`.
#[tokio::test]
async fn install_results_are_counted_by_failing_step() {
    dataplane::enter_test_group!();
    use cni_agent::metrics::{InstallResults, ResultLabel};
    let count = |results: &InstallResults, result: &str| {
        results
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .get()
    };
    let not_a_dir = |path: &Path| {
        std::fs::remove_dir_all(path).ok();
        std::fs::write(path, "a file where a directory belongs").unwrap();
    };
    let standalone = [("CHAINED_CNI_PLUGIN", "false")];

    let node = Node::new();
    not_a_dir(&node.bin);
    let results = InstallResults::default();
    let mut installer = Installer::new(node.config(&standalone)).count_results(results.clone());
    assert!(installer.install_all().await.is_err());
    assert_eq!(count(&results, "COPY_BINARIES_FAILURE"), 1);

    let node = Node::new();
    not_a_dir(&node.run);
    let mut installer = Installer::new(node.config(&standalone)).count_results(results.clone());
    assert!(installer.install_all().await.is_err());
    assert_eq!(count(&results, "CREATE_KUBECONFIG_FAILURE"), 1);

    let node = Node::new();
    not_a_dir(&node.conf);
    let mut installer = Installer::new(node.config(&standalone)).count_results(results.clone());
    assert!(installer.install_all().await.is_err());
    assert_eq!(count(&results, "CREATE_CNI_CONFIG_FAILURE"), 1);
    assert_eq!(count(&results, "SUCCESS"), 0);

    let node = Node::new();
    let mut installer = Installer::new(node.config(&standalone)).count_results(results.clone());
    let mut ready = installer.readiness();
    let task = tokio::spawn(async move { installer.run().await });
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|r| *r))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(count(&results, "SUCCESS"), 1);
    assert_eq!(count(&results, "COPY_BINARIES_FAILURE"), 1);
    task.abort();
}

/// Istio's `istio.io/pkg/log` flags are accepted (Helm and operators pass them) and do what they say.
#[test]
fn istio_log_flags_are_accepted_and_take_effect() {
    dataplane::enter_test_group!();
    let node = Node::new();
    node.put("10-calico.conflist", &fixture("pre/calico.conflist"));
    let logs = tempfile::tempdir().unwrap();
    let file = logs.path().join("agent.log");
    let target = format!("--log_target={}", file.display());
    let out = node
        .command(
            &[&target, "--log_caller=cni-agent", "install", "--once"],
            &[],
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("wrote kubeconfig"), "{text}");
    // --log_caller: the source location of each record.
    assert!(text.contains("install.rs:"), "{text}");
    // The file replaced the default target.
    assert!(!String::from_utf8_lossy(&out.stderr).contains("wrote kubeconfig"));

    let rotated = logs.path().join("rotated.log");
    let rotate = format!("--log_rotate={}", rotated.display());
    let out = node
        .command(
            &[
                "--log_target=stderr",
                &rotate,
                "--log_rotate_max_size=1",
                "--log_rotate_max_backups=2",
                "--log_rotate_max_age=1",
                "--log_stacktrace_level=default:error,cni-agent:none",
                "--log_as_json",
                "install",
                "--once",
            ],
            &[],
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("wrote kubeconfig"), "{stderr}");
    let text = std::fs::read_to_string(&rotated).unwrap();
    assert!(text.lines().count() > 1, "{text}");
    for line in text.lines() {
        serde_json::from_str::<Value>(line).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
    // Without --log_caller no location is printed.
    assert!(!text.contains("install.rs"), "{text}");

    for (flag, named) in [
        ("--log_stacktrace_level=loud", "--log_stacktrace_level"),
        ("--log_rotate_max_size=0", "--log_rotate_max_size"),
        ("--log_target=/nonexistent-dir/agent.log", "--log_target"),
    ] {
        let mut args = vec![flag, "install", "--once"];
        if flag.starts_with("--log_rotate_max") {
            args.insert(0, &rotate);
        }
        let out = node.command(&args, &[]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(named),
            "{flag}: {stderr}"
        );
    }
}
