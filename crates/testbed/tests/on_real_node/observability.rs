//! The chart's observability kit (issue #38): the PodMonitor, the PrometheusRule and the Grafana
//! dashboard it renders when asked (`monitoring.*.enabled`), proven with a real Prometheus
//! (Debian's `prometheus` and `promtool`, `scripts/setup`).
//!
//! - `kit_is_opt_in_and_alert_rules_fire_on_captured_series` (no root, seconds): the kit is absent
//!   from a default render; the PodMonitor selects the DaemonSet's pods and names their metrics
//!   port; `promtool check rules` passes on the rendered rules and `promtool test rules` runs
//!   [`CAPTURED`] against them: unit tests whose input series were scraped from the agent on the
//!   real node during each fault (written by the next test), each alert firing on its fault and
//!   silent before it.
//! - `monitoring_kit_against_prometheus_on_the_real_node` (root, one real node, minutes): Prometheus
//!   in the node's namespaces scrapes the agent through a scrape config derived from the rendered
//!   PodMonitor (its namespaces, selector, port name and path, matched against the node's pods:
//!   Debian's Prometheus has no Kubernetes discovery) with the rendered rules loaded. Faults on the node (a pod's rules flushed, pods whose ADD
//!   fails, the ZDS peer stopped, the primary CNI config taken away, the agent killed): each
//!   alert's expression returns data during its fault and Prometheus holds the alert pending or
//!   firing. The series scraped during each fault become a `promtool test rules` case (one scrape
//!   per `interval` of rule time, so a fault of seconds spans an alert's `for`), run at once and
//!   written to `target/observability/alerts_test.yaml` (the source of [`CAPTURED`]). After a
//!   small workload, every dashboard query returns a value.

#[path = "observability/prometheus.rs"]
mod prometheus;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use testbed::manifests::{render_chart, repo_file};
use testbed::real_node::{
    CONFLIST, GATEWAY, PEER, RealNode, VALUES, create, sidecar_pod, wait_redirection, wait_running,
    witness_pod,
};

use prometheus::{Prometheus, STEP, now, scrape_configs};

/// The promtool unit tests of the alerts, as the real-node test captured them.
const CAPTURED: &str = "crates/testbed/tests/on_real_node/observability/alerts_test.yaml";
/// Every part of the kit turned on.
const KIT: [&str; 6] = [
    "--set",
    "monitoring.podMonitor.enabled=true",
    "--set",
    "monitoring.prometheusRule.enabled=true",
    "--set",
    "monitoring.dashboard.enabled=true",
];
/// The alerts docs/metrics.md describes.
const ALERTS: [&str; 5] = [
    "IstioCniAgentDown",
    "IstioCniInstallNotReady",
    "IstioCniZtunnelDisconnected",
    "IstioCniAddFailures",
    "IstioCniDriftRepairs",
];
const NS: &str = "observed";
/// Scrapes captured before each fault began.
const HEALTHY: usize = 10;

/// One real node at a time (a node is several hundred MB and most of a core to start).
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The chart rendered with the real node's values (ambient) and `extra`, as JSON objects.
fn render(extra: &[&str]) -> Vec<Value> {
    let values = repo_file(VALUES);
    let mut args = vec!["-f", values.to_str().unwrap()];
    args.extend_from_slice(extra);
    render_chart(&args)
        .into_iter()
        .map(|o| serde_json::to_value(o).unwrap())
        .collect()
}

fn kind<'a>(objects: &'a [Value], kind: &str) -> Option<&'a Value> {
    objects.iter().find(|o| o["kind"] == kind)
}

struct Kit {
    objects: Vec<Value>,
}

impl Kit {
    fn render() -> Kit {
        Kit {
            objects: render(&KIT),
        }
    }

    fn pod_monitor(&self) -> &Value {
        kind(&self.objects, "PodMonitor").expect("a PodMonitor")
    }

    /// The alerting rules, in their group's order.
    fn alerts(&self) -> Vec<Value> {
        let rule = kind(&self.objects, "PrometheusRule").expect("a PrometheusRule");
        rule["spec"]["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().clone())
            .filter(|r| r.get("alert").is_some())
            .collect()
    }

    fn alert(&self, name: &str) -> Value {
        self.alerts()
            .into_iter()
            .find(|r| r["alert"] == name)
            .unwrap_or_else(|| panic!("no alert {name}"))
    }

    /// The PrometheusRule's spec as a Prometheus rule file in `dir`.
    fn write_rules(&self, dir: &Path) -> PathBuf {
        let rule = kind(&self.objects, "PrometheusRule").unwrap();
        let path = dir.join("rules.yaml");
        std::fs::write(&path, serde_yaml::to_string(&rule["spec"]).unwrap()).unwrap();
        path
    }

    /// The dashboard's panels' (title, query) pairs.
    fn dashboard_queries(&self) -> Vec<(String, String)> {
        let cm = self
            .objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "istio-cni-dashboard")
            .expect("the dashboard ConfigMap");
        let json: Value = serde_json::from_str(cm["data"]["istio-cni.json"].as_str().unwrap())
            .expect("the dashboard is JSON");
        json["panels"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|p| {
                let title = p["title"].as_str().unwrap().to_string();
                p["targets"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(move |t| (title.clone(), t["expr"].as_str().unwrap().to_string()))
            })
            .collect()
    }
}

/// `promtool ARGS` in `dir`: (success, output).
fn promtool(dir: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool (scripts/setup installs Debian's prometheus)");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// `promtool check rules` then `promtool test rules` of `tests` (a promtool test file naming
/// `rules.yaml`) with the kit's rules; panics with promtool's output on failure.
fn check_and_test_rules(kit: &Kit, tests: &str) {
    let dir = tempfile::tempdir().unwrap();
    kit.write_rules(dir.path());
    let (ok, out) = promtool(dir.path(), &["check", "rules", "rules.yaml"]);
    assert!(ok, "promtool check rules:\n{out}");
    std::fs::write(dir.path().join("alerts_test.yaml"), tests).unwrap();
    let (ok, out) = promtool(dir.path(), &["test", "rules", "alerts_test.yaml"]);
    assert!(ok, "promtool test rules:\n{out}\n{tests}");
}

#[test]
fn kit_is_opt_in_and_alert_rules_fire_on_captured_series() {
    dataplane::enter_test_group!();
    let plain = render(&[]);
    for k in ["PodMonitor", "PrometheusRule"] {
        assert!(kind(&plain, k).is_none(), "{k} in a default render");
    }
    assert!(
        !plain
            .iter()
            .any(|o| o["metadata"]["name"] == "istio-cni-dashboard"),
        "dashboard in a default render"
    );

    let kit = Kit::render();
    // The PodMonitor selects the DaemonSet's pods, in its namespace, on a port they declare.
    let ds = kind(&kit.objects, "DaemonSet").unwrap();
    let pod_labels = ds["spec"]["template"]["metadata"]["labels"]
        .as_object()
        .unwrap();
    let pm = kit.pod_monitor();
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(pod_labels.get(k), Some(v), "selector {k}={v}");
    }
    assert_eq!(
        pm["spec"]["namespaceSelector"]["matchNames"],
        json!([ds["metadata"]["namespace"]])
    );
    let ports: Vec<&Value> = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["name"])
        .collect();
    for e in pm["spec"]["podMetricsEndpoints"].as_array().unwrap() {
        assert!(
            ports.contains(&&e["port"]),
            "{} not in {ports:?}",
            e["port"]
        );
    }
    let dashboard = kit
        .objects
        .iter()
        .find(|o| o["metadata"]["name"] == "istio-cni-dashboard")
        .unwrap();
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    assert!(kit.dashboard_queries().len() >= 10);

    let names: Vec<String> = kit
        .alerts()
        .iter()
        .map(|r| r["alert"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ALERTS);
    // Sidecar mode has no ztunnel: no alert on it.
    let sidecar = render(&["--set", "ambient.enabled=false"])
        .into_iter()
        .chain(render(
            &[&KIT[..], &["--set", "ambient.enabled=false"]].concat(),
        ))
        .filter(|o| o["kind"] == "PrometheusRule")
        .map(|r| r.to_string())
        .collect::<String>();
    assert!(
        !sidecar.is_empty() && !sidecar.contains("IstioCniZtunnelDisconnected"),
        "{sidecar}"
    );

    let captured = std::fs::read_to_string(repo_file(CAPTURED)).unwrap();
    let tests: Value = serde_yaml::from_str(&captured).unwrap();
    let tested: Vec<&str> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .filter(|a| !a["exp_alerts"].as_array().unwrap().is_empty())
        .map(|a| a["alertname"].as_str().unwrap())
        .collect();
    for alert in ALERTS {
        assert!(tested.contains(&alert), "{CAPTURED} never fires {alert}");
    }
    check_and_test_rules(&kit, &captured);
}

/// One alert's fault as scraped: the alert's input series from `start` to `end` (the alert's
/// expression returned data at `end`), with what the expression returned then.
struct Fault {
    alert: &'static str,
    /// The alert's input series (a selector of Prometheus' own API).
    input: String,
    /// Rule time per scrape (promtool's `interval`).
    interval: &'static str,
    start: f64,
    end: f64,
    series: Vec<Value>,
    fired: Vec<Value>,
}

/// A promtool test case of `fault`: its series, one scrape per `interval`; the alert evaluated
/// at the fault's last scrape (where it must fire, with the labels the real Prometheus gave its
/// expression and the rule's annotations) and at the scrape before the fault began (silent).
fn promtool_case(kit: &Kit, fault: &Fault) -> Value {
    let steps = ((fault.end - fault.start) / STEP.as_secs_f64()).round() as usize;
    let input_series: Vec<Value> = fault
        .series
        .iter()
        .map(|s| {
            let metric = s["metric"].as_object().unwrap();
            let name = metric["__name__"].as_str().unwrap();
            let labels: Vec<String> = metric
                .iter()
                .filter(|(k, _)| *k != "__name__")
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let mut values = vec!["_".to_string(); steps + 1];
            for v in s["values"].as_array().unwrap() {
                let t = v[0].as_f64().unwrap();
                let i = ((t - fault.start) / STEP.as_secs_f64()).round() as usize;
                values[i] = v[1].as_str().unwrap().to_string();
            }
            json!({
                "series": format!("{name}{{{}}}", labels.join(",")),
                "values": values.join(" "),
            })
        })
        .collect();
    let rule = kit.alert(fault.alert);
    let interval = parse_duration(fault.interval);
    let at = |i: usize| format!("{}s", interval.as_secs() * i as u64);
    let exp_alerts: Vec<Value> = fault
        .fired
        .iter()
        .map(|f| {
            let mut labels = f["metric"].as_object().unwrap().clone();
            // A filtering comparison keeps the metric's name; an alert drops it.
            labels.remove("__name__");
            for (k, v) in rule["labels"].as_object().unwrap() {
                labels.insert(k.clone(), v.clone());
            }
            let annotations: serde_json::Map<String, Value> = rule["annotations"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), json!(expand(v.as_str().unwrap(), &labels))))
                .collect();
            json!({"exp_labels": labels, "exp_annotations": annotations})
        })
        .collect();
    json!({
        "name": format!("{} on the real node", fault.alert),
        "interval": fault.interval,
        "input_series": input_series,
        "alert_rule_test": [
            {"eval_time": at(HEALTHY - 1), "alertname": fault.alert, "exp_alerts": []},
            {"eval_time": at(steps), "alertname": fault.alert, "exp_alerts": exp_alerts},
        ],
    })
}

/// An annotation with its `{{ $labels.NAME }}` filled in (the only template the rules use).
fn expand(template: &str, labels: &serde_json::Map<String, Value>) -> String {
    let mut out = template.to_string();
    for (k, v) in labels {
        out = out.replace(&format!("{{{{ $labels.{k} }}}}"), v.as_str().unwrap());
    }
    assert!(!out.contains("{{"), "unexpanded template in {out:?}");
    out
}

fn parse_duration(d: &str) -> Duration {
    let (n, unit) = d.split_at(d.len() - 1);
    let n: u64 = n.parse().unwrap();
    match unit {
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(60 * n),
        _ => panic!("duration {d}"),
    }
}

/// The sample values of the one series of `input` between `start` and `end`, by time.
fn values_of(prom: &Prometheus<'_>, input: &str, start: f64, end: f64) -> Vec<f64> {
    prom.query_range(input, start, end)
        .first()
        .map(|s| {
            s["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v[1].as_str().unwrap().parse().unwrap())
                .collect()
        })
        .unwrap_or_default()
}

/// The node, its Prometheus and the kit it runs.
struct Observed<'a> {
    node: &'a RealNode,
    prom: &'a Prometheus<'a>,
    kit: &'a Kit,
}

impl Observed<'_> {
    /// Waits until `done` says the fault begun at `began` has been scraped long enough, with the
    /// alert's expression returning data and Prometheus holding the alert (pending or firing);
    /// then captures its input series `input` from [`HEALTHY`] scrapes before `began`.
    async fn capture(
        &self,
        alert: &'static str,
        input: &str,
        interval: &'static str,
        began: f64,
        mut done: impl FnMut(&Prometheus<'_>, f64) -> bool,
    ) -> Fault {
        let (prom, kit) = (self.prom, self.kit);
        let expr = kit.alert(alert)["expr"].as_str().unwrap().to_string();
        let started = Instant::now();
        loop {
            let end = now().floor();
            let fired = prom.query(&expr);
            let held = prom.query(&format!("ALERTS{{alertname=\"{alert}\"}}"));
            if !fired.is_empty() && !held.is_empty() && done(prom, end) {
                let start = began.floor() - HEALTHY as f64;
                let series = prom.query_range(input, start, end);
                eprintln!(
                    "{alert}: expression returned {} series, alert {}, after {:?}",
                    fired.len(),
                    held[0]["metric"]["alertstate"],
                    started.elapsed()
                );
                return Fault {
                    alert,
                    input: input.to_string(),
                    interval,
                    start,
                    end,
                    series,
                    fired,
                };
            }
            assert!(
                started.elapsed() < Duration::from_secs(180),
                "{alert}: its expression {expr} returned {fired:?}, ALERTS {held:?}, after {:?}\n{}",
                started.elapsed(),
                self.node.log_tails(&["kubelet"])
            );
            tokio::time::sleep(STEP).await;
        }
    }
}

/// Whether the last `n` samples of `input` up to `end` are all `value`.
fn held(prom: &Prometheus<'_>, input: &str, end: f64, n: usize, value: f64) -> bool {
    let v = values_of(prom, input, end - n as f64 + 1.0, end);
    v.len() >= n && v[v.len() - n..].iter().all(|x| *x == value)
}

/// How many times counter `input` went up between `start` and `end`.
fn increases(prom: &Prometheus<'_>, input: &str, start: f64, end: f64) -> usize {
    let v = values_of(prom, input, start, end);
    v.windows(2).filter(|w| w[1] > w[0]).count()
}

/// A sidecar pod whose `istio-validation` init container stands in for Istio's: it exits 126
/// unless a connection out (to the node's bridge) lands on the proxy's outbound port 15001.
/// Created before the agent installs the plugin, it is broken until the repair controller
/// programs its rules.
fn broken_sidecar_pod(name: &str) -> Value {
    let mut p = sidecar_pod(name, GATEWAY);
    let validation = format!(
        "nc -ll -p 15001 -e true & sleep 0.3; nc -w 1 {GATEWAY} 9 </dev/null && exit 0; exit 126"
    );
    p["spec"]["initContainers"] = json!([{
        "name": "istio-validation",
        "image": "localhost/istio-cni-rs/busybox:dev",
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", validation],
    }]);
    p
}

fn ambient_pod(name: &str) -> Value {
    witness_pod(name, "sleep 3600")
}

async fn workload(node: &RealNode, names: &[&str]) -> Vec<String> {
    let mut uids = Vec::new();
    for name in names {
        uids.push(create(node, NS, ambient_pod(name)).await);
    }
    for name in names {
        wait_running(node, NS, name).await;
        wait_redirection(node, NS, name, Some("enabled")).await;
    }
    uids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitoring_kit_against_prometheus_on_the_real_node() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let began = Instant::now();
    let kit = Kit::render();
    let node = RealNode::up().await;
    // Sidecar mode's failure: a pod started before the plugin was in the chain.
    node.namespace("side", false).await;
    create(&node, "side", broken_sidecar_pod("broken")).await;
    node.eventually(
        "istio-validation failed with 126",
        Duration::from_secs(60),
        || {
            let out = node.kubectl(&[
                "-n",
                "side",
                "get",
                "pod",
                "broken",
                "-o",
                "jsonpath={.status.initContainerStatuses[0].lastState.terminated.exitCode}",
            ]);
            async move { (out.trim() == "126").then_some(()) }
        },
    )
    .await;
    node.install_chart(&["--set-string", "env.DRIFT_CHECK_INTERVAL_SECONDS=2"])
        .await;
    let dir = tempfile::tempdir_in(node.dir()).unwrap();
    let rules = kit.write_rules(dir.path());
    let prom = Prometheus::start(
        &node,
        dir.path(),
        scrape_configs(
            kit.pod_monitor(),
            &serde_json::from_str(&node.kubectl(&["get", "pods", "-A", "-o", "json"])).unwrap(),
        ),
        &rules,
    )
    .await;
    let loaded: Vec<Value> = prom.rules();
    assert_eq!(loaded.len(), ALERTS.len(), "{loaded:?}");
    assert!(loaded.iter().all(|r| r["health"] != "err"), "{loaded:?}");
    let job = format!(
        "{}/istio-cni-node",
        kit.pod_monitor()["metadata"]["namespace"].as_str().unwrap()
    );
    let up = format!("up{{job=\"{job}\"}}");
    node.eventually(
        "the agent scraped through the PodMonitor's selector",
        Duration::from_secs(60),
        || {
            let ok = prom.query(&format!("{up} == 1")).len() == 1;
            async move { ok.then_some(()) }
        },
    )
    .await;
    wait_running(&node, "side", "broken").await;
    node.namespace(NS, true).await;
    let uids = workload(&node, &["web-0", "web-1"]).await;
    let seen = Observed {
        node: &node,
        prom: &prom,
        kit: &kit,
    };
    eprintln!(
        "node up, chart installed, Prometheus scraping, pods enrolled: {:?}",
        began.elapsed()
    );

    let mut faults = Vec::new();
    // Drift: a pod's rules flushed behind the agent's back.
    let t = now();
    let netns = node.pod_netns(&uids[0]).expect("web-0's netns");
    testbed::migrate::netns_exec(&netns, "nft", &["flush", "ruleset"]);
    let drift = "istio_cni_drift_repairs_total{scope=\"pod\"}";
    faults.push(
        seen.capture("IstioCniDriftRepairs", drift, "1m", t, |p, end| {
            increases(p, drift, t, end) >= 1 && end - t >= 3.0
        })
        .await,
    );

    // ADDs that fail: an interface name Linux cannot have, in the pods' own settings; kubelet
    // retries each sandbox.
    let t = now();
    let bad = ["bad-0", "bad-1", "bad-2"];
    for name in bad {
        let mut p = ambient_pod(name);
        p["metadata"]["annotations"] =
            json!({"istio.io/reroute-virtual-interfaces": "x".repeat(20)});
        create(&node, NS, p).await;
    }
    let failed = "istio_cni_plugin_requests_total{response_code=\"500\"}";
    // 15s of rule time a scrape: the 5m rate windows span kubelet's retries, and the failures
    // must last the alert's 5m `for` (20 scrapes) and one window (20 more).
    faults.push(
        seen.capture("IstioCniAddFailures", failed, "15s", t, |p, end| {
            end - t >= 50.0 && increases(p, failed, end - 20.0, end) >= 1
        })
        .await,
    );
    for name in bad {
        node.kubectl(&["-n", NS, "delete", "pod", name, "--wait=false"]);
    }

    // The ZDS peer (ztunnel's stand-in) stopped.
    let t = now();
    node.kubectl(&[
        "-n",
        "istio-system",
        "delete",
        "ds",
        "ztunnel",
        "--wait=true",
    ]);
    faults.push(
        seen.capture(
            "IstioCniZtunnelDisconnected",
            "ztunnel_connected",
            "1m",
            t,
            |p, end| held(p, "ztunnel_connected", end, 8, 0.0),
        )
        .await,
    );
    node.kubectl(&["apply", "-f", repo_file(PEER).to_str().unwrap()]);
    node.rollout("ztunnel").await;

    // The primary CNI config taken away: the installer waits for it.
    let t = now();
    let held_conf = "/etc/cni/10-bridge.conflist.held";
    node.node(1).exec(&["mv", CONFLIST, held_conf]);
    faults.push(
        seen.capture(
            "IstioCniInstallNotReady",
            "istio_cni_install_ready",
            "1m",
            t,
            |p, end| held(p, "istio_cni_install_ready", end, 8, 0.0),
        )
        .await,
    );
    node.node(1).exec(&["mv", held_conf, CONFLIST]);
    node.eventually("installed again", Duration::from_secs(60), || {
        let ok = !prom.query("istio_cni_install_ready == 1").is_empty();
        async move { ok.then_some(()) }
    })
    .await;

    // A small workload, then every panel has data.
    workload(&node, &["web-2", "web-3"]).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut empty = BTreeMap::new();
        for (title, expr) in kit.dashboard_queries() {
            let values: Vec<f64> = prom
                .query(&expr)
                .iter()
                .filter_map(|r| r["value"][1].as_str()?.parse().ok())
                .filter(|v: &f64| v.is_finite())
                .collect();
            if values.is_empty() {
                empty.insert(title, expr);
            }
        }
        if empty.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "dashboard panels without data: {empty:#?}"
        );
        tokio::time::sleep(STEP).await;
    }
    eprintln!(
        "{} dashboard queries with data; total {:?}",
        kit.dashboard_queries().len(),
        began.elapsed()
    );

    // The agent killed, again once kubelet has restarted it: the second restart waits out
    // kubelet's back-off, long enough for several failed scrapes in a row.
    let t = now();
    let mut kills = 0;
    let agent_down = loop {
        kills += 1;
        assert!(
            kills <= 6,
            "{kills} kills and never 7 failed scrapes in a row"
        );
        let _ = node
            .node(1)
            .try_script(&["exec", "pkill", "-KILL", "-x", "install-cni"]);
        let mut down = 0;
        for _ in 0..10 {
            tokio::time::sleep(STEP).await;
            if held(&prom, &up, now().floor(), 7, 0.0) {
                break;
            }
            if prom.query(&format!("{up} == 1")).is_empty() {
                down += 1;
            } else if down > 0 {
                break;
            }
        }
        if held(&prom, &up, now().floor(), 7, 0.0) {
            break seen
                .capture("IstioCniAgentDown", &up, "1m", t, |p, end| {
                    held(p, &up, end, 7, 0.0)
                })
                .await;
        }
    };
    faults.push(agent_down);
    node.rollout("istio-cni-node").await;
    eprintln!("faults captured ({kills} kill(s)): {:?}", began.elapsed());

    // The captured series as promtool unit tests, run now and kept for the fast test.
    let cases: Vec<Value> = faults.iter().map(|f| promtool_case(&kit, f)).collect();
    let file = json!({
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "15s",
        "tests": cases,
    });
    let header = "# promtool unit tests of the chart's alerts: each input series was scraped from the \
                  agent\n# on the real node during the alert's fault, one scrape per `interval`, by \
                  tests/on_real_node/observability.rs\n# (monitoring_kit_against_prometheus_on_the_real_node, \
                  which writes\n# target/observability/alerts_test.yaml). Run against the rendered \
                  rules by\n# kit_is_opt_in_and_alert_rules_fire_on_captured_series.\n";
    let text = format!("{header}{}", serde_yaml::to_string(&file).unwrap());
    let out = repo_file("target/observability");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("alerts_test.yaml"), &text).unwrap();
    check_and_test_rules(&kit, &text);
    for f in &faults {
        eprintln!(
            "{}: {} series of {} over {:.0}s",
            f.alert,
            f.series.len(),
            f.input,
            f.end - f.start
        );
    }
}
