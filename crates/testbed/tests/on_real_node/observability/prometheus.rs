//! A real Prometheus (Debian's `prometheus` package, `scripts/setup`) run inside the real node's
//! namespaces, scraping what the chart's PodMonitor selects. Debian builds Prometheus without
//! Kubernetes service discovery (`kubernetes_sd_configs` is not a field of its config), so the
//! discovery a Prometheus Operator would configure is done here: the node's pods are matched
//! against the PodMonitor's namespaces and `matchLabels`, each endpoint's port is looked up by
//! name in the pod's containers, and the target gets the operator's labels (`namespace`, `pod`,
//! `container`, `endpoint`, job `<namespace>/<name>`).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use testbed::real_node::RealNode;

/// Where Prometheus listens, inside the node's own network namespace (no host port is taken).
const LISTEN: &str = "127.0.0.1:9090";
/// Scrapes and rule evaluations every second: a fault of seconds leaves several samples.
pub const STEP: Duration = Duration::from_secs(1);

/// One scrape job per endpoint of `pod_monitor` (a rendered `monitoring.coreos.com/v1`
/// PodMonitor), its targets the pods of `pods` (a `kubectl get pods -A -o json` list) it selects.
pub fn scrape_configs(pod_monitor: &Value, pods: &Value) -> Vec<Value> {
    let ns = pod_monitor["metadata"]["namespace"].as_str().unwrap();
    let name = pod_monitor["metadata"]["name"].as_str().unwrap();
    let spec = &pod_monitor["spec"];
    let namespaces: Vec<&str> = spec["namespaceSelector"]["matchNames"]
        .as_array()
        .map(|n| n.iter().map(|v| v.as_str().unwrap()).collect())
        .unwrap_or_else(|| vec![ns]);
    let match_labels = spec["selector"]["matchLabels"]
        .as_object()
        .expect("the PodMonitor selects by matchLabels");
    assert!(
        spec["selector"].get("matchExpressions").is_none(),
        "matchExpressions are not derived here"
    );
    let selected: Vec<&Value> = pods["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| namespaces.contains(&p["metadata"]["namespace"].as_str().unwrap()))
        .filter(|p| {
            match_labels
                .iter()
                .all(|(k, v)| &p["metadata"]["labels"][k] == v)
        })
        .collect();
    spec["podMetricsEndpoints"]
        .as_array()
        .expect("podMetricsEndpoints")
        .iter()
        .enumerate()
        .map(|(i, endpoint)| {
            let port = endpoint["port"]
                .as_str()
                .expect("endpoints name their port");
            let targets: Vec<Value> = selected
                .iter()
                .flat_map(|p| {
                    p["spec"]["containers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter_map(move |c| {
                            let number = c["ports"]
                                .as_array()?
                                .iter()
                                .find(|cp| cp["name"] == port)?["containerPort"]
                                .as_u64()?;
                            Some(json!({
                                "targets": [format!("{}:{number}", p["status"]["podIP"].as_str()?)],
                                "labels": {
                                    "namespace": p["metadata"]["namespace"],
                                    "pod": p["metadata"]["name"],
                                    "container": c["name"],
                                    "endpoint": port,
                                    "job": format!("{ns}/{name}"),
                                },
                            }))
                        })
                })
                .collect();
            json!({
                "job_name": format!("podMonitor/{ns}/{name}/{i}"),
                "metrics_path": endpoint["path"].as_str().unwrap_or("/metrics"),
                "static_configs": targets,
            })
        })
        .collect()
}

/// Prometheus inside the node, killed on drop.
pub struct Prometheus<'a> {
    node: &'a RealNode,
    child: Child,
}

impl<'a> Prometheus<'a> {
    /// Starts Prometheus with `scrape_configs` and the rule file `rules`, its data under `dir`,
    /// and waits until it answers.
    pub async fn start(
        node: &'a RealNode,
        dir: &Path,
        scrape_configs: Vec<Value>,
        rules: &Path,
    ) -> Self {
        let config = json!({
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "900ms",
                "evaluation_interval": "1s",
            },
            "rule_files": [rules],
            "scrape_configs": scrape_configs,
        });
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, serde_yaml::to_string(&config).unwrap()).unwrap();
        let check = Command::new("promtool")
            .arg("check")
            .arg("config")
            .arg(&config_file)
            .output()
            .expect("promtool (scripts/setup installs Debian's prometheus)");
        assert!(
            check.status.success(),
            "promtool check config: {}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(repo().join("scripts/real-node"))
            .env("REAL_NODE_DIR", node.dir())
            .args(["exec", "prometheus"])
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={LISTEN}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            // Its own process group: dropped, the whole chain (script, nsenter, prometheus) dies.
            .process_group(0)
            .spawn()
            .expect("scripts/real-node exec prometheus");
        let p = Prometheus { node, child };
        let log_file = dir.join("prometheus.log");
        node.eventually("prometheus ready", Duration::from_secs(60), || {
            let ok = p.get("/-/ready", &[]).is_some();
            let log = log_file.clone();
            async move {
                if !ok
                    && std::fs::read_to_string(&log)
                        .unwrap_or_default()
                        .contains("level=error")
                {
                    panic!(
                        "prometheus failed:\n{}",
                        std::fs::read_to_string(&log).unwrap()
                    );
                }
                ok.then_some(())
            }
        })
        .await;
        p
    }

    /// GET `path` with URL-encoded `params` from inside the node; `None` if it does not answer.
    fn get(&self, path: &str, params: &[(&str, &str)]) -> Option<String> {
        let url = format!("http://{LISTEN}{path}");
        let mut args = vec!["curl".to_string(), "-sfG".into(), url];
        for (k, v) in params {
            args.push("--data-urlencode".into());
            args.push(format!("{k}={v}"));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self
            .node
            .node(1)
            .try_script(&[&["exec"][..], &args].concat());
        out.status
            .success()
            .then(|| String::from_utf8(out.stdout).unwrap())
    }

    fn api(&self, path: &str, params: &[(&str, &str)]) -> Value {
        let body = self
            .get(path, params)
            .unwrap_or_else(|| panic!("prometheus {path} {params:?}: no answer"));
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{path} {params:?}: {v}");
        v["data"].clone()
    }

    /// The instant vector of `expr` now.
    pub fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api("/api/v1/query", &[("query", expr)]);
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// The range of `expr` from `start` to `end` at [`STEP`].
    pub fn query_range(&self, expr: &str, start: f64, end: f64) -> Vec<Value> {
        let (start, end, step) = (
            format!("{start:.3}"),
            format!("{end:.3}"),
            STEP.as_secs().to_string(),
        );
        let data = self.api(
            "/api/v1/query_range",
            &[
                ("query", expr),
                ("start", &start),
                ("end", &end),
                ("step", &step),
            ],
        );
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// The rules Prometheus loaded, with their health.
    pub fn rules(&self) -> Vec<Value> {
        self.api("/api/v1/rules", &[])["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().clone())
            .collect()
    }
}

impl Drop for Prometheus<'_> {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(-(self.child.id() as i32));
        let _ = nix::sys::signal::kill(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Seconds since the epoch, as Prometheus' API takes them.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}
