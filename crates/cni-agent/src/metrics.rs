//! The agent's metrics: Istio's names and labels exactly (dashboards and alerts keep working), plus
//! latency histograms Istio does not have. Counters are registered without `_total`;
//! prometheus-client appends it, giving Istio's exported names.

pub mod process;

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    pub r#type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RepairLabels {
    pub r#type: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseCodeLabel {
    pub response_code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    pub backend: String,
}

/// `istio_cni_drift_repairs_total`: the backend, and whether a pod's rules (`pod`) or the host's
/// probe rules and sets (`host`) were repaired.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DriftLabel {
    pub backend: String,
    pub scope: &'static str,
}

/// `istio_cni_build_info`: which build runs on a node, and with which rule backend, so a fleet
/// part-way through an upgrade or a migration from Istio's agent can be followed node by node.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
    pub revision: String,
    pub backend: String,
}

impl BuildLabels {
    /// This binary's: the release's version and commit when `scripts/release` built it (it sets
    /// `ISTIO_CNI_RS_VERSION` and `ISTIO_CNI_RS_REVISION`), else the crate's version and
    /// `unknown`.
    pub fn this_build(backend: &str) -> Self {
        BuildLabels {
            version: option_env!("ISTIO_CNI_RS_VERSION")
                .unwrap_or(env!("CARGO_PKG_VERSION"))
                .to_string(),
            revision: option_env!("ISTIO_CNI_RS_REVISION")
                .unwrap_or("unknown")
                .to_string(),
            backend: backend.to_string(),
        }
    }
}

/// `istio_cni_installs_total`, by `result`.
pub type InstallResults = Family<ResultLabel, Counter>;

/// Istio's values of `istio_cni_installs_total{result}`.
pub mod install_result {
    pub const SUCCESS: &str = "SUCCESS";
    pub const COPY_BINARIES_FAILURE: &str = "COPY_BINARIES_FAILURE";
    pub const CREATE_KUBECONFIG_FAILURE: &str = "CREATE_KUBECONFIG_FAILURE";
    pub const CREATE_CNI_CONFIG_FAILURE: &str = "CREATE_CNI_CONFIG_FAILURE";
}

/// Every metric the agent exports. Cloning shares the underlying values.
#[derive(Clone)]
pub struct Metrics {
    /// `istio_cni_installs_total{result}`
    pub installs: InstallResults,
    /// `istio_cni_install_ready`
    pub install_ready: Gauge,
    /// `istio_cni_repair_pods_repaired_total{type,result}`
    pub pods_repaired: Family<RepairLabels, Counter>,
    /// `nodeagent_reconcile_events_total{type}`
    pub reconcile_events: Family<TypeLabel, Counter>,
    /// `ztunnel_connected`
    pub ztunnel_connected: Gauge,
    /// `istio_cni_plugin_requests_total{response_code}`
    pub plugin_requests: Family<ResponseCodeLabel, Counter>,
    /// CNI ADD handled by the agent, from request to response.
    pub cni_add_seconds: Histogram,
    /// Opening a pod's netns (CNI path) or discovering it under /proc.
    pub netns_resolve_seconds: Histogram,
    /// Programming a pod's routes and rules, per backend.
    pub rule_apply_seconds: Family<BackendLabel, Histogram>,
    /// ZDS request sent → ack received.
    pub zds_ack_seconds: Histogram,
    /// Informer event seen → pod enrolled and annotated.
    pub event_to_enrolled_seconds: Histogram,
    /// Enrolled pods whose rules, and host probe states, found drifted (changed, removed) and
    /// re-applied.
    pub drift_repairs: Family<DriftLabel, Counter>,
    /// `istio_cni_build_info{version,revision,backend}`, 1 for this build ([`Metrics::set_build`]).
    pub build_info: Family<BuildLabels, Gauge>,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~3.3 s: rule applies are sub-millisecond, a slow API patch takes seconds.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 17))
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            installs: Family::default(),
            install_ready: Gauge::default(),
            pods_repaired: Family::default(),
            reconcile_events: Family::default(),
            ztunnel_connected: Gauge::default(),
            plugin_requests: Family::default(),
            cni_add_seconds: latency_histogram(),
            netns_resolve_seconds: latency_histogram(),
            rule_apply_seconds: Family::new_with_constructor(latency_histogram),
            zds_ack_seconds: latency_histogram(),
            event_to_enrolled_seconds: latency_histogram(),
            drift_repairs: Family::default(),
            build_info: Family::default(),
        };
        registry.register(
            "istio_cni_installs",
            "Install cycles by result",
            m.installs.clone(),
        );
        registry.register(
            "istio_cni_install_ready",
            "1 when the CNI config is installed",
            m.install_ready.clone(),
        );
        registry.register(
            "istio_cni_repair_pods_repaired",
            "Pods repaired",
            m.pods_repaired.clone(),
        );
        registry.register(
            "nodeagent_reconcile_events",
            "Pod and namespace events processed",
            m.reconcile_events.clone(),
        );
        registry.register(
            "ztunnel_connected",
            "Connected ztunnels",
            m.ztunnel_connected.clone(),
        );
        registry.register(
            "istio_cni_plugin_requests",
            "CNI plugin events handled",
            m.plugin_requests.clone(),
        );
        registry.register(
            "istio_cni_add_duration_seconds",
            "Ambient CNI ADD handled by the agent",
            m.cni_add_seconds.clone(),
        );
        registry.register(
            "istio_cni_netns_resolve_duration_seconds",
            "Pod netns open or discovery",
            m.netns_resolve_seconds.clone(),
        );
        registry.register(
            "istio_cni_rule_apply_duration_seconds",
            "In-pod routes and rules applied",
            m.rule_apply_seconds.clone(),
        );
        registry.register(
            "istio_cni_zds_ack_duration_seconds",
            "ZDS request to ztunnel ack",
            m.zds_ack_seconds.clone(),
        );
        registry.register(
            "istio_cni_event_to_enrolled_duration_seconds",
            "Pod event seen to pod enrolled and annotated",
            m.event_to_enrolled_seconds.clone(),
        );
        registry.register(
            "istio_cni_drift_repairs",
            "Drifted in-pod rules (scope pod) and host probe rules or sets (scope host) re-applied",
            m.drift_repairs.clone(),
        );
        registry.register(
            "istio_cni_build_info",
            "1 for the build running: its version, commit and rule backend",
            m.build_info.clone(),
        );
        registry.register_collector(Box::new(process::ProcessCollector::current()));
        m
    }

    /// Exports this build with rule backend `backend` (`iptables` or `nftables`).
    pub fn set_build(&self, backend: &str) {
        self.build_info
            .get_or_create(&BuildLabels::this_build(backend))
            .set(1);
    }
}

/// Records a duration into a histogram in seconds.
pub fn observe(h: &Histogram, d: Duration) {
    h.observe(d.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn exports_istio_metric_names() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        m.installs
            .get_or_create(&ResultLabel {
                result: "SUCCESS".into(),
            })
            .inc();
        m.install_ready.set(1);
        m.pods_repaired
            .get_or_create(&RepairLabels {
                r#type: "repair".into(),
                result: "success".into(),
            })
            .inc();
        m.reconcile_events
            .get_or_create(&TypeLabel {
                r#type: "update".into(),
            })
            .inc();
        m.ztunnel_connected.set(2);
        m.plugin_requests
            .get_or_create(&ResponseCodeLabel {
                response_code: "200".into(),
            })
            .inc();
        observe(&m.zds_ack_seconds, Duration::from_micros(80));
        m.set_build("nftables");
        let this = BuildLabels::this_build("nftables");
        let build = format!(
            "istio_cni_build_info{{version=\"{}\",revision=\"{}\",backend=\"nftables\"}} 1",
            this.version, this.revision
        );
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            "istio_cni_installs_total{result=\"SUCCESS\"} 1",
            "istio_cni_install_ready 1",
            "istio_cni_repair_pods_repaired_total{type=\"repair\",result=\"success\"} 1",
            "nodeagent_reconcile_events_total{type=\"update\"} 1",
            "ztunnel_connected 2",
            "istio_cni_plugin_requests_total{response_code=\"200\"} 1",
            "istio_cni_zds_ack_duration_seconds_count 1",
            "istio_cni_zds_ack_duration_seconds_bucket{le=\"0.0001\"} 1",
            &build,
            "# TYPE process_cpu_seconds counter",
            "# TYPE process_resident_memory_bytes gauge",
            "# TYPE process_open_fds gauge",
            "# TYPE process_max_fds gauge",
            "# TYPE process_virtual_memory_bytes gauge",
            "# TYPE process_start_time_seconds gauge",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
        // CPU time can still be 0 ticks this early; memory and fds cannot.
        for (sample, min) in [
            ("process_cpu_seconds_total", 0.0),
            ("process_resident_memory_bytes", 1.0),
            ("process_open_fds", 1.0),
        ] {
            let value: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
                .unwrap_or_else(|| panic!("no {sample} sample in:\n{text}"))
                .parse()
                .unwrap();
            assert!(value >= min, "{sample} = {value}");
        }
    }

    /// docs/metrics.md lists exactly the metric families the agent registers: nothing documented
    /// that is never emitted, nothing emitted that is undocumented.
    #[test]
    fn metrics_doc_lists_what_is_registered() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        // A labelled family is exported once it has a series.
        let result = ResultLabel {
            result: "SUCCESS".into(),
        };
        m.installs.get_or_create(&result).inc();
        let repair = RepairLabels {
            r#type: "repair".into(),
            result: "success".into(),
        };
        m.pods_repaired.get_or_create(&repair).inc();
        let kind = TypeLabel {
            r#type: "add".into(),
        };
        m.reconcile_events.get_or_create(&kind).inc();
        let code = ResponseCodeLabel {
            response_code: "200".into(),
        };
        m.plugin_requests.get_or_create(&code).inc();
        let backend = BackendLabel {
            backend: "nftables".into(),
        };
        m.rule_apply_seconds.get_or_create(&backend).observe(0.001);
        m.drift_repairs
            .get_or_create(&DriftLabel {
                backend: "nftables".into(),
                scope: "pod",
            })
            .inc();
        m.set_build("iptables");
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        let exported = |family: &str, kind: &str| match kind {
            "counter" => format!("{family}_total"),
            _ => family.to_string(),
        };
        let mut registered: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (family, kind) = l.split_once(' ').unwrap();
                exported(family, kind)
            })
            .collect();
        registered.sort();
        let doc = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/metrics.md"
        ))
        .unwrap();
        // The first cell of each table row names a metric.
        let mut documented: Vec<String> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
            .filter(|name| {
                ["istio_cni_", "nodeagent_", "ztunnel_", "process_"]
                    .iter()
                    .any(|p| name.starts_with(p))
                    && name.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            })
            .map(str::to_string)
            .collect();
        documented.sort();
        documented.dedup();
        assert_eq!(documented, registered);
    }
}
