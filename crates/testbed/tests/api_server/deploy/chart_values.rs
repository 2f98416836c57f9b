//! What the chart's values do, rendered with helm (no API server): Istio's profiles and
//! compatibility versions, Istio's legacy `cni.` prefix, the GKE bin dir, AppArmor by Kubernetes
//! version, and values Istio's chart ignores. The expected settings are those Istio's own chart
//! renders for the same values (`chart_conformance.rs` compares the two charts object by object),
//! including where Istio's result is surprising: a profile beats the user's own value, and
//! unknown keys are ignored (our install notes warn about both).

use kube::api::DynamicObject;
use serde_json::{Value, json};

use super::fake_cluster::FakeCluster;
use super::{render, try_render};
use testbed::manifests;

/// One render of the chart, with lookups into the objects the agent's behaviour depends on.
struct Rendered(Vec<DynamicObject>);

impl Rendered {
    /// `--set` each of `values`, plus extra raw helm arguments.
    fn with(values: &[&str], extra: &[&str]) -> Rendered {
        Rendered(render(&args(values, extra)))
    }

    fn set(values: &[&str]) -> Rendered {
        Rendered::with(values, &[])
    }

    fn json(&self) -> Value {
        serde_json::to_value(&self.0).unwrap()
    }

    fn object(&self, kind: &str, name: &str) -> Option<Value> {
        self.0
            .iter()
            .find(|o| manifests::kind(o) == kind && o.metadata.name.as_deref() == Some(name))
            .map(|o| serde_json::to_value(o).unwrap())
    }

    fn has(&self, kind: &str) -> bool {
        self.0.iter().any(|o| manifests::kind(o) == kind)
    }

    /// A key of ConfigMap `istio-cni-config` (the agent's environment).
    fn config(&self, key: &str) -> Option<String> {
        let cm = self
            .object("ConfigMap", "istio-cni-config")
            .expect("ConfigMap");
        cm["data"][key].as_str().map(str::to_string)
    }

    fn pod(&self) -> Value {
        let ds = self
            .object("DaemonSet", "istio-cni-node")
            .expect("DaemonSet");
        ds["spec"]["template"].clone()
    }

    fn container(&self) -> Value {
        self.pod()["spec"]["containers"][0].clone()
    }

    fn host_path(&self, volume: &str) -> Option<String> {
        self.pod()["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == volume)
            .and_then(|v| v["hostPath"]["path"].as_str())
            .map(str::to_string)
    }

    fn mounts(&self) -> Vec<String> {
        self.container()["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["mountPath"].as_str().unwrap().to_string())
            .collect()
    }

    fn env_names(&self) -> Vec<String> {
        self.container()["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect()
    }

    fn host_network(&self) -> bool {
        self.pod()["spec"]["hostNetwork"] == json!(true)
    }

    fn apparmor_annotation(&self) -> Option<String> {
        self.pod()["metadata"]["annotations"]["container.apparmor.security.beta.kubernetes.io/install-cni"]
            .as_str()
            .map(str::to_string)
    }
}

fn args<'a>(values: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let mut out = Vec::new();
    for v in values {
        out.extend(["--set", v]);
    }
    out.extend(extra);
    out
}

/// The render must fail, and helm's message must contain `want`.
fn fails(values: &[&str], extra: &[&str], want: &str) {
    match try_render(&args(values, extra)) {
        Ok(_) => panic!("{values:?} {extra:?} rendered; want an error with {want:?}"),
        Err(e) => assert!(e.contains(want), "{values:?}: error lacks {want:?}: {e}"),
    }
}

fn ambient_mounted(r: &Rendered) -> bool {
    let m = r.mounts();
    m.iter().any(|p| p == "/host/var/run/netns") && m.iter().any(|p| p == "/var/run/ztunnel")
}

#[test]
fn every_istio_profile_renders_with_its_agent_settings() {
    let default = Rendered::set(&[]);
    assert_eq!(default.config("AMBIENT_ENABLED").unwrap(), "false");
    assert_eq!(Rendered::set(&["profile=default"]).json(), default.json());

    for ambient in [
        Rendered::set(&["profile=ambient"]),
        Rendered::set(&["global.profile=ambient"]),
    ] {
        assert_eq!(ambient.config("AMBIENT_ENABLED").unwrap(), "true");
        assert!(ambient_mounted(&ambient), "{:?}", ambient.mounts());
        // Istio's ambient profile also picks its images' `-distroless` tag, and so does ours.
        let image = ambient.container()["image"].as_str().unwrap().to_string();
        assert!(image.ends_with("-distroless"), "{image}");
    }

    let demo = Rendered::set(&["profile=demo"]);
    assert_eq!(
        demo.container()["resources"],
        json!({"requests": {"cpu": "10m", "memory": "40Mi"}})
    );
    assert_eq!(demo.config("AMBIENT_ENABLED").unwrap(), "false");

    // These change only values of Istio's other charts: the render is the default one.
    for profile in ["preview", "remote", "stable"] {
        let r = Rendered::set(&[&format!("profile={profile}")]);
        assert_eq!(r.json(), default.json(), "profile={profile}");
    }

    // The profile beats what the user sets, as in Istio's chart: turning ambient off this way
    // must not take every pod out of the mesh on an upgrade from Istio's chart.
    let r = Rendered::set(&["profile=ambient", "ambient.enabled=false"]);
    assert_eq!(r.config("AMBIENT_ENABLED").unwrap(), "true");
    let r = Rendered::set(&["profile=demo", "resources.requests.cpu=50m"]);
    assert_eq!(
        r.container()["resources"],
        json!({"requests": {"cpu": "10m", "memory": "40Mi"}})
    );

    fails(&["profile=bogus"], &[], "unknown profile \"bogus\"");
    fails(
        &["global.profile=minimal"],
        &[],
        "unknown profile \"minimal\"",
    );
}

#[test]
fn compatibility_versions_bring_back_older_agent_behaviour() {
    // (version, AMBIENT_RECONCILE_POD_RULES_ON_STARTUP, agent pod in the host netns)
    let table = [
        ("1.25", "false", true),
        ("1.26", "false", false),
        ("1.27", "false", false),
        ("1.28", "false", false),
        ("1.29", "true", false),
        ("1.30", "true", false),
    ];
    let ambient = Rendered::set(&["profile=ambient"]);
    for (version, reconcile, host_network) in table {
        let r = Rendered::set(&[
            "profile=ambient",
            &format!("compatibilityVersion={version}"),
        ]);
        assert_eq!(
            r.config("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP").unwrap(),
            reconcile,
            "{version}"
        );
        assert_eq!(r.host_network(), host_network, "{version}");
        // In the host netns there is no switching into it.
        assert_eq!(
            r.env_names()
                .contains(&"ALLOW_SWITCH_TO_HOST_NS".to_string()),
            !host_network,
            "{version}"
        );
        if reconcile == "true" {
            assert_eq!(r.json(), ambient.json(), "{version} changes nothing");
        }
    }
    let r = Rendered::set(&[
        "profile=ambient",
        "compatibilityVersion=1.25",
        "ambient.shareHostNetworkNamespace=false",
    ]);
    assert!(!r.host_network(), "the user's value beats the version's");
    // `compatibilityVersion: 1.30` in a values file is the number 1.3.
    let r = Rendered::with(
        &["profile=ambient"],
        &["--set-json", "compatibilityVersion=1.3"],
    );
    assert_eq!(r.json(), ambient.json());

    fails(
        &["compatibilityVersion=1.31"],
        &[],
        "unknown compatibilityVersion \"1.31\"",
    );
    fails(
        &["compatibilityVersion=1.24"],
        &[],
        "unknown compatibilityVersion \"1.24\"",
    );
}

#[test]
fn legacy_cni_prefix_is_the_same_as_the_plain_value() {
    // (values, a check that they took effect)
    type Check = fn(&Rendered) -> bool;
    let cases: [(&[&str], Check); 9] = [
        (&["ambient.enabled=true"], |r| {
            r.config("AMBIENT_ENABLED").unwrap() == "true" && ambient_mounted(r)
        }),
        (&["repair.enabled=false"], |r| {
            r.config("REPAIR_ENABLED").unwrap() == "false"
                && r.object("ClusterRole", "istio-cni-repair-role").is_none()
        }),
        (&["chained=false"], |r| {
            r.config("CHAINED_CNI_PLUGIN").unwrap() == "false"
        }),
        (&["cniConfFileName=10-calico.conflist"], |r| {
            r.config("CNI_CONF_NAME").as_deref() == Some("10-calico.conflist")
        }),
        (&["cniBinDir=/x/bin", "cniConfDir=/x/net.d"], |r| {
            r.host_path("cni-bin-dir").as_deref() == Some("/x/bin")
                && r.host_path("cni-net-dir").as_deref() == Some("/x/net.d")
        }),
        (&["provider=multus"], |r| {
            r.has("NetworkAttachmentDefinition")
        }),
        (
            &["resourceQuotas.enabled=true", "resourceQuotas.pods=64"],
            |r| {
                r.object("ResourceQuota", "istio-cni-resource-quota")
                    .is_some_and(|q| q["spec"]["hard"]["pods"] == "64")
            },
        ),
        (
            &["repair.repairPods=false", "repair.deletePods=true"],
            |r| {
                r.config("REPAIR_DELETE_PODS").unwrap() == "true"
                    && r.config("REPAIR_REPAIR_PODS").unwrap() == "false"
            },
        ),
        (&["excludeNamespaces={a,b}"], |r| {
            r.config("EXCLUDE_NAMESPACES").unwrap() == "a,b"
        }),
    ];
    let default = Rendered::set(&[]);
    for (values, took_effect) in cases {
        let plain = Rendered::set(values);
        assert!(took_effect(&plain), "{values:?}");
        assert!(!took_effect(&default), "{values:?} is not the default");
        let prefixed: Vec<String> = values.iter().map(|v| format!("cni.{v}")).collect();
        let prefixed: Vec<&str> = prefixed.iter().map(String::as_str).collect();
        assert_eq!(
            Rendered::set(&prefixed).json(),
            plain.json(),
            "{prefixed:?}"
        );
    }

    // Within what the user set, the prefixed value wins, as in Istio's chart, whose merge applies
    // the user's `cni.` values after the profile: there the user beats the profile (the plain
    // value loses to it, above).
    let r = Rendered::set(&["ambient.enabled=true", "cni.ambient.enabled=false"]);
    assert_eq!(r.config("AMBIENT_ENABLED").unwrap(), "false");
    let r = Rendered::set(&["profile=ambient", "cni.ambient.enabled=false"]);
    assert_eq!(r.config("AMBIENT_ENABLED").unwrap(), "false");
    // Istio's chart selects profiles, platforms and versions only without the prefix.
    for value in [
        "cni.profile=ambient",
        "cni.platform=gke",
        "cni.compatibilityVersion=1.25",
    ] {
        assert_eq!(Rendered::set(&[value]).json(), default.json(), "{value}");
    }
}

#[test]
fn gke_bin_dir_follows_the_platform() {
    for kube in [
        &[][..],
        &["--kube-version", "1.29.0"],
        &["--kube-version", "1.33.1"],
    ] {
        let r = Rendered::with(&["global.platform=gke"], kube);
        assert_eq!(
            r.host_path("cni-bin-dir").as_deref(),
            Some("/home/kubernetes/bin"),
            "{kube:?}"
        );
        assert!(
            r.has("ResourceQuota"),
            "GKE admits system-node-critical pods only with one"
        );
    }
    // The profile's bin dir beats the user's, as in Istio's chart.
    let r = Rendered::set(&["platform=gke", "cniBinDir=/custom/bin"]);
    assert_eq!(
        r.host_path("cni-bin-dir").as_deref(),
        Some("/home/kubernetes/bin")
    );
    // Elsewhere (helm template's own version has no `-gke`) the empty default and an explicit
    // empty value, as Istio's shared GKE profile sets, are /opt/cni/bin.
    for values in [&[][..], &["cni.cniBinDir="]] {
        let r = Rendered::set(values);
        assert_eq!(r.host_path("cni-bin-dir").as_deref(), Some("/opt/cni/bin"));
    }
}

/// What `helm install` sees: the cluster's own version string, `-gke` suffix included.
#[test]
fn gke_cluster_version_picks_the_gke_bin_dir_without_a_platform() {
    let against = |git_version: &str, values: &[&str]| {
        let cluster = FakeCluster::start(git_version);
        let extra = [
            "--validate",
            "--disable-openapi-validation",
            "--kubeconfig",
            cluster.kubeconfig(),
        ];
        try_render(&args(values, &extra)).map(Rendered)
    };
    let bin_dir = |r: Rendered| r.host_path("cni-bin-dir").unwrap();
    let gke = "v1.30.5-gke.1014001";
    assert_eq!(bin_dir(against(gke, &[]).unwrap()), "/home/kubernetes/bin");
    assert_eq!(bin_dir(against("v1.30.5", &[]).unwrap()), "/opt/cni/bin");
    assert_eq!(
        bin_dir(against(gke, &["cniBinDir=/opt/cni/bin"]).unwrap()),
        "/opt/cni/bin",
        "a value set beats the detection"
    );
    // The AppArmor field is rendered as Istio's chart renders it, whatever the cluster's
    // version (the install notes warn below 1.30, where the API server drops the field).
    let r = against("v1.31.1-gke.1", &["useAppArmorAnnotation=false"]).unwrap();
    assert_eq!(
        r.container()["securityContext"]["appArmorProfile"],
        json!({"type": "Unconfined"})
    );
}

#[test]
fn apparmor_is_the_annotation_or_the_field_by_kubernetes_version() {
    let field = |r: &Rendered| r.container()["securityContext"]["appArmorProfile"].clone();
    for kube in ["1.29.0", "1.30.0"] {
        let r = Rendered::with(&[], &["--kube-version", kube]);
        assert_eq!(
            r.apparmor_annotation().as_deref(),
            Some("unconfined"),
            "{kube}"
        );
        assert_eq!(
            field(&r),
            Value::Null,
            "{kube}: Kubernetes 1.29 rejects the field"
        );
    }
    for kube in ["1.30.0", "1.34.4"] {
        let r = Rendered::with(&["useAppArmorAnnotation=false"], &["--kube-version", kube]);
        assert_eq!(r.apparmor_annotation(), None, "{kube}");
        assert_eq!(field(&r), json!({"type": "Unconfined"}), "{kube}");
    }
    // Below 1.30 Istio's chart renders the field all the same (an upgrade it accepts must not
    // fail with ours); the install notes warn.
    let r = Rendered::with(
        &["useAppArmorAnnotation=false"],
        &["--kube-version", "1.29.9"],
    );
    assert_eq!(field(&r), json!({"type": "Unconfined"}));
}

/// Istio's chart after the pin (1.31.0) gained annotations on the DaemonSet object itself; a
/// chart pinned in GitOps with them set must render them, and nothing changes without them.
#[test]
fn daemonset_annotations_land_on_the_daemonset_object_only() {
    let default = Rendered::set(&[]);
    let ds = |r: &Rendered| r.object("DaemonSet", "istio-cni-node").expect("DaemonSet");
    assert_eq!(ds(&default)["metadata"]["annotations"], Value::Null);
    // As with Istio's chart, annotation values are strings: `--set-string`.
    let r = Rendered::with(
        &[],
        &[
            "--set-string",
            "daemonSetAnnotations.pulumi\\.com/skipAwait=true",
        ],
    );
    assert_eq!(
        ds(&r)["metadata"]["annotations"],
        json!({"pulumi.com/skipAwait": "true"})
    );
    assert_eq!(r.pod(), default.pod(), "the pods' template must not change");
}

#[test]
fn unknown_values_are_ignored_as_istio_ignores_them() {
    let default = Rendered::set(&[]);
    // Misspelt and older charts' keys render what Istio's chart renders: nothing changes (the
    // install notes name them).
    for value in [
        "foo=1",
        "cni.bar=1",
        "ambient.enabeld=true",
        "cni.repair.lablePods=true",
        "resourceQuotas.pod=1",
        "cni.cni.chained=false",
        "rollingMaxUnavailable=2",
        "cni.logLevel=debug",
        "ambient.redirectMode=ebpf",
    ] {
        assert_eq!(Rendered::set(&[value]).json(), default.json(), "{value}");
    }
    fails(
        &["defaults.hub=x"],
        &[],
        "values under `defaults` are not read",
    );
    fails(&["cni=5"], &[], "value `cni` must be a map");

    // Accepted and ignored: the top-level keys of Istio's other charts (Istio's shared profile
    // files carry them) and `global.*`, which all of Istio's charts share.
    let r = Rendered::set(&[
        "pilot.env.PILOT_ENABLE_AMBIENT=true",
        "meshConfig.accessLogFile=/dev/stdout",
        "ztunnel.resources.requests.cpu=10m",
        "global.meshID=mesh1",
    ]);
    assert_eq!(r.json(), default.json());
    // Free-form maps are not checked inside.
    let r = Rendered::set(&["env.SOME_SETTING=1", "podLabels.team=net"]);
    assert_eq!(r.config("SOME_SETTING").as_deref(), Some("1"));
}
