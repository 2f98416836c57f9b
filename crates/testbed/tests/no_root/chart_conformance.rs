//! Conformance of our chart (`deploy/charts/istio-cni`) with Istio's `istio-cni` chart: the same
//! values file, rendered by both with `helm template`, must give the same Kubernetes objects.
//!
//! Istio's chart comes from the pinned Istio module (`tools/istio/go.mod`): its directory is
//! `$ISTIO_MODULE_DIR`, else what `tools/istio/moddir.sh` prints. It is copied into a temporary
//! directory and given what Istio's release step (`make copy-templates`) adds to it: the shared
//! profiles of `manifests/helm-profiles` as `files/profile-*.yaml`, and
//! `manifests/zzz_profile.yaml` as `templates/zzz_profile.yaml` (globals not flattened, as for
//! this chart). helm is `$HELM`, else what `tools/helm/build.sh` prints.
//!
//! Comparison rules:
//! - Objects are matched by kind, namespace and name; within an object, field by field. A field
//!   that is `null` equals an absent one (the API server reads both as unset). Lists whose items
//!   all have a unique `name` (containers, env, volumes, mounts) are compared item by item by
//!   name, other lists by position.
//! - A render that fails in both charts conforms (the messages are not compared); one that fails
//!   in one chart only is a difference.
//! - Container images: Istio's image is `<hub>/install-cni:<tag>[-<variant>]`. Ours must be the
//!   same, variant included, with Istio's default hub (its `values.yaml`) read as ours. Pull
//!   policy is compared as any other field.
//!
//! Every difference must be listed under `chart:` in `tools/istio/conformance-allowlist.yaml`
//! (`case` and `difference` are globs, `*` matching anything, over the case name and the
//! difference line printed below; `why` says why we differ). An entry that matches nothing in a
//! run is stale and fails the test.
//!
//! Our chart's `NOTES.txt` must carry a `WARNING:` line where Istio's result is surprising (a
//! profile's value beating the user's own, a value that is ignored); each case lists the
//! warnings it expects, and a case that lists none must get none. Besides those, every case whose
//! agent image is under our local default hub and is pulled (no `imagePullPolicy: Never`) must get
//! the warning that no registry serves it ([`LOCAL_HUB_WARNING`]), and no other case may. NOTES
//! are rendered by `helm install --dry-run` against a stub API server (helm does not render them
//! otherwise).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};

#[path = "../api_server/deploy/fake_cluster.rs"]
mod fake_cluster;
use fake_cluster::FakeCluster;

const ALLOWLIST: &str = "tools/istio/conformance-allowlist.yaml";
/// Our chart's local default hub: images under it are in no registry.
const LOCAL_HUB: &str = "localhost/istio-cni-rs/";
/// What our NOTES' warning about an image under [`LOCAL_HUB`] that would be pulled says.
const LOCAL_HUB_WARNING: &str = "which no registry serves";
const ALLOWLIST_KEY: &str = "chart";
const RELEASE: &str = "istio-cni";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

/// `$VAR` if set (it must exist), else the last line `script` prints.
fn tool_path(var: &str, script: &str, what: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(var) {
        let path = PathBuf::from(path);
        assert!(
            path.exists(),
            "{var}={} does not exist: point it at {what}, or unset it to use {script}",
            path.display()
        );
        return path;
    }
    let out = Command::new(repo_root().join(script))
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {script} ({e}); or set {var}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or("").trim();
    assert!(
        out.status.success() && !last.is_empty() && Path::new(last).exists(),
        "{what}: {script} failed ({}), set {var} instead:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(last)
}

fn helm() -> PathBuf {
    tool_path("HELM", "tools/helm/build.sh", "the helm binary")
}

fn istio_module() -> PathBuf {
    let dir = tool_path(
        "ISTIO_MODULE_DIR",
        "tools/istio/moddir.sh",
        "the pinned Istio module's directory",
    );
    assert!(
        dir.join("manifests/charts/istio-cni/Chart.yaml").exists(),
        "{} has no manifests/charts/istio-cni: not the Istio module",
        dir.display()
    );
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            // Plain write, not fs::copy: the module cache's files are read-only.
            std::fs::write(&target, std::fs::read(entry.path()).unwrap()).unwrap();
        }
    }
}

/// The two charts side by side, Istio's completed as its release does.
struct Charts {
    _tmp: tempfile::TempDir,
    helm: PathBuf,
    istio: PathBuf,
    ours: PathBuf,
    /// Istio's shared profiles (`manifests/helm-profiles`), also passed as values files.
    istio_profiles: PathBuf,
    istio_hub: String,
    our_hub: String,
}

impl Charts {
    fn prepare() -> Charts {
        let helm = helm();
        let module = istio_module();
        let tmp = tempfile::tempdir().unwrap();
        let istio = tmp.path().join("istio-cni");
        copy_dir(&module.join("manifests/charts/istio-cni"), &istio);
        let profiles = module.join("manifests/helm-profiles");
        let files = istio.join("files");
        if files.exists() {
            for f in std::fs::read_dir(&files).unwrap() {
                let f = f.unwrap();
                if f.file_name().to_string_lossy().starts_with("profile-") {
                    std::fs::remove_file(f.path()).unwrap();
                }
            }
        }
        std::fs::create_dir_all(&files).unwrap();
        let mut copied = 0;
        for f in std::fs::read_dir(&profiles).unwrap() {
            let f = f.unwrap();
            let name = f.file_name().to_string_lossy().to_string();
            if name.ends_with(".yaml") {
                std::fs::copy(f.path(), files.join(format!("profile-{name}"))).unwrap();
                copied += 1;
            }
        }
        assert!(
            copied > 10,
            "only {copied} profiles in {}",
            profiles.display()
        );
        let zzz = std::fs::read_to_string(module.join("manifests/zzz_profile.yaml")).unwrap();
        assert!(
            zzz.contains("FLATTEN_GLOBALS_REPLACEMENT"),
            "zzz_profile.yaml changed"
        );
        std::fs::write(
            istio.join("templates/zzz_profile.yaml"),
            zzz.replace("FLATTEN_GLOBALS_REPLACEMENT", "false"),
        )
        .unwrap();
        let ours = repo_root().join("deploy/charts/istio-cni");
        let default_hub = |chart: &Path| -> String {
            let values: Value =
                serde_yaml::from_str(&std::fs::read_to_string(chart.join("values.yaml")).unwrap())
                    .unwrap();
            values["_internal_defaults_do_not_set"]["global"]["hub"]
                .as_str()
                .expect("a default global.hub")
                .to_string()
        };
        Charts {
            helm,
            istio_hub: default_hub(&istio),
            our_hub: default_hub(&ours),
            istio,
            ours,
            istio_profiles: profiles,
            _tmp: tmp,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The matrix.

/// How helm learns the Kubernetes version.
#[derive(Clone, Copy)]
enum Kube {
    /// helm's built-in default.
    Default,
    /// `--kube-version`.
    Version(&'static str),
    /// `--validate` against a stub API server reporting this `gitVersion` (which can carry a
    /// `-gke` suffix; `--kube-version` drops it).
    Cluster(&'static str),
}

#[derive(Clone, Copy)]
enum Values {
    Yaml(&'static str),
    /// One of Istio's shared profile files (`manifests/helm-profiles/<name>`), as is.
    IstioProfileFile(&'static str),
}

struct Case {
    name: &'static str,
    values: Values,
    namespace: &'static str,
    kube: Kube,
    /// Substrings of the `WARNING:` lines our NOTES must print (one line each).
    warns: Vec<&'static str>,
}

fn case(name: &'static str, yaml: &'static str) -> Case {
    Case {
        name,
        values: Values::Yaml(yaml),
        namespace: "istio-system",
        kube: Kube::Default,
        warns: Vec::new(),
    }
}

impl Case {
    fn warns(mut self, w: &[&'static str]) -> Case {
        self.warns.extend_from_slice(w);
        self
    }
    fn namespace(mut self, ns: &'static str) -> Case {
        self.namespace = ns;
        self
    }
    fn kube(mut self, k: Kube) -> Case {
        self.kube = k;
        self
    }
}

fn matrix() -> Vec<Case> {
    let mut m = vec![
        // Profiles Istio ships (and one it does not).
        case("no values", ""),
        case("profile=ambient", "profile: ambient"),
        case("profile=demo", "profile: demo"),
        case("profile=preview", "profile: preview"),
        case("profile=remote", "profile: remote"),
        case("profile=stable", "profile: stable"),
        case("profile=default", "profile: default"),
        case("profile=bogus", "profile: bogus"),
        case("global.profile=ambient", "global: {profile: ambient}"),
        case(
            "profile beats global.profile",
            "profile: demo\nglobal: {profile: ambient}",
        ),
        // Platforms.
        case("global.platform=gke", "global: {platform: gke}"),
        case("global.platform=k3d", "global: {platform: k3d}"),
        case("global.platform=k3s", "global: {platform: k3s}"),
        case("global.platform=microk8s", "global: {platform: microk8s}"),
        case("global.platform=minikube", "global: {platform: minikube}"),
        case(
            "global.platform=minikube ambient",
            "global: {platform: minikube}\nambient: {enabled: true}",
        ),
        case("global.platform=openshift", "global: {platform: openshift}"),
        case(
            "global.platform=openshift ambient",
            "global: {platform: openshift}\nprofile: ambient",
        ),
        case("platform=k3s", "platform: k3s"),
        case(
            "platform beats global.platform",
            "platform: openshift\nglobal: {platform: k3s}",
        ),
        case("global.platform=bogus", "global: {platform: bogus}"),
        // Compatibility versions (quoted, as Istio's chart needs them).
        case(
            "compatibilityVersion=1.25",
            "compatibilityVersion: \"1.25\"",
        ),
        case(
            "compatibilityVersion=1.25 ambient",
            "compatibilityVersion: \"1.25\"\nprofile: ambient",
        ),
        case(
            "compatibilityVersion=1.26 ambient",
            "compatibilityVersion: \"1.26\"\nprofile: ambient",
        ),
        case(
            "compatibilityVersion=1.27 ambient",
            "compatibilityVersion: \"1.27\"\nprofile: ambient",
        ),
        case(
            "compatibilityVersion=1.28 ambient",
            "compatibilityVersion: \"1.28\"\nprofile: ambient",
        ),
        case(
            "compatibilityVersion=1.29 ambient",
            "compatibilityVersion: \"1.29\"\nprofile: ambient",
        ),
        case(
            "compatibilityVersion=1.30 ambient",
            "compatibilityVersion: \"1.30\"\nprofile: ambient",
        ),
        case(
            "compatibilityVersion=1.24",
            "compatibilityVersion: \"1.24\"",
        ),
        case(
            "compatibilityVersion number 1.26",
            "compatibilityVersion: 1.26\nprofile: ambient",
        ),
        case(
            "compatibilityVersion number 1.30",
            "compatibilityVersion: 1.30\nprofile: ambient",
        ),
        // Istio's shared profile files passed as values files.
    ];
    for file in [
        "ambient.yaml",
        "demo.yaml",
        "preview.yaml",
        "remote.yaml",
        "stable.yaml",
        "platform-gke.yaml",
        "platform-k3d.yaml",
        "platform-k3s.yaml",
        "platform-microk8s.yaml",
        "platform-minikube.yaml",
        "platform-openshift.yaml",
        "compatibility-version-1.25.yaml",
        "compatibility-version-1.26.yaml",
        "compatibility-version-1.27.yaml",
        "compatibility-version-1.28.yaml",
        "compatibility-version-1.29.yaml",
        "compatibility-version-1.30.yaml",
    ] {
        m.push(Case {
            name: file,
            values: Values::IstioProfileFile(file),
            ..case("", "")
        });
    }
    m.extend([
        // The legacy `cni.` prefix.
        case("cni.chained=false", "cni: {chained: false}"),
        case("cni.ambient.enabled", "cni: {ambient: {enabled: true}}"),
        case(
            "cni.excludeNamespaces",
            "cni: {excludeNamespaces: [a, b]}",
        ),
        case(
            "cni prefix beats plain",
            "ambient: {enabled: true}\ncni: {ambient: {enabled: false}}",
        ),
        case(
            "cni section of an IstioOperator",
            "cni:\n  cniBinDir: /x/bin\n  cniConfDir: /x/net.d\n  chained: false\n  \
             cniConfFileName: 10-calico.conflist\n  excludeNamespaces: [kube-system, istio-system]\n  \
             ambient: {enabled: true, dnsCapture: false}\n  repair: {enabled: true, deletePods: true, repairPods: false}\n  \
             resourceQuotas: {enabled: true, pods: 64}\n  provider: multus\n\
             global: {hub: docker.io/istio, tag: 1.28.0}",
        ),
        case("cni.resources", "cni: {resources: {limits: {memory: 1Gi}}}"),
        case(
            "cni.repair label",
            "cni: {repair: {repairPods: false, labelPods: true}}",
        ),
        // Everyday settings.
        case(
            "tolerations",
            "tolerations: [{key: node-role.kubernetes.io/control-plane, operator: Exists, effect: NoSchedule}]",
        ),
        case("tolerations empty", "tolerations: []"),
        case(
            "resources",
            "resources: {requests: {cpu: 200m, memory: 64Mi}, limits: {cpu: '1', memory: 512Mi}}",
        ),
        case("resources empty", "resources: {}"),
        case(
            "global.defaultResources",
            "global: {defaultResources: {requests: {cpu: 1m}}}",
        ),
        case("hub and tag", "hub: registry.example.com/mesh\ntag: 1.2.3"),
        case(
            "global.hub and global.tag",
            "global: {hub: registry.example.com/mesh, tag: 1.2.3}",
        ),
        case("image with a slash", "image: registry.example.com/cni/agent:v9"),
        case("image name", "image: my-install-cni\nglobal: {tag: t1}"),
        case(
            "pullPolicy",
            "pullPolicy: Always\nglobal: {imagePullPolicy: IfNotPresent}",
        ),
        case(
            "global.imagePullPolicy",
            "global: {imagePullPolicy: IfNotPresent}",
        ),
        case(
            "global.imagePullSecrets",
            "global: {imagePullSecrets: [pull-a, pull-b]}",
        ),
        case("excludeNamespaces", "excludeNamespaces: [kube-system, team-a]"),
        case("excludeNamespaces empty", "excludeNamespaces: []"),
        case(
            "ambient settings",
            "ambient:\n  enabled: true\n  dnsCapture: false\n  ipv6: false\n  \
             reconcileIptablesOnStartup: false\n  enableAmbientDetectionRetry: true",
        ),
        case(
            "ambient shareHostNetworkNamespace",
            "ambient: {enabled: true, shareHostNetworkNamespace: true}",
        ),
        case(
            "shareHostNetworkNamespace without ambient",
            "ambient: {shareHostNetworkNamespace: true}",
        ),
        case(
            "ambient enablementSelectors",
            "ambient:\n  enabled: true\n  enablementSelectors:\n  - podSelector:\n      matchLabels: {mesh: ambient}",
        ),
        case("logging.level", "logging: {level: 'cni-agent:debug'}"),
        case("global.logging.level", "global: {logging: {level: debug}}"),
        case(
            "no log level",
            "logging: {level: ''}\nglobal: {logging: {level: ''}}",
        ),
        case("global.logAsJson", "global: {logAsJson: true}"),
        case(
            "host dirs",
            "cniBinDir: /x/bin\ncniConfDir: /x/net.d\ncniNetnsDir: /x/netns\n\
             cniConfFileName: 10-flannel.conflist\nambient: {enabled: true}",
        ),
        case("cniBinDir empty", "cniBinDir: ''"),
        case(
            "istioOwnedCNIConfig",
            "istioOwnedCNIConfig: true\nistioOwnedCNIConfigFileName: 01-istio.conflist\nambient: {enabled: true}",
        ),
        case("istioOwnedCNIConfig default name", "istioOwnedCNIConfig: true"),
        case(
            "istioOwnedCNIConfigFileName alone",
            "istioOwnedCNIConfigFileName: 01-istio.conflist",
        )
        .warns(&["istioOwnedCNIConfigFileName"]),
        case("chained=false", "chained: false"),
        case("provider=multus", "provider: multus"),
        case(
            "repair deletePods",
            "repair: {repairPods: false, deletePods: true}",
        ),
        case(
            "repair labelPods",
            "repair: {repairPods: false, labelPods: true, brokenPodLabelKey: k, brokenPodLabelValue: v, initContainerName: init}",
        ),
        case("repair disabled", "repair: {enabled: false}"),
        case(
            "repair disabled, no repairPods",
            "repair: {enabled: false, repairPods: false}",
        ),
        case("seccompProfile", "seccompProfile: {type: RuntimeDefault}"),
        case("seLinuxOptions", "seLinuxOptions: {level: 's0:c1'}"),
        case(
            "seLinuxOptions with type",
            "seLinuxOptions: {type: container_t, level: 's0'}",
        ),
        case(
            "AppArmor field, Kubernetes 1.30",
            "useAppArmorAnnotation: false",
        )
        .kube(Kube::Version("1.30.0")),
        case(
            "AppArmor field, Kubernetes 1.29",
            "useAppArmorAnnotation: false",
        )
        .kube(Kube::Version("1.29.0"))
        .warns(&["useAppArmorAnnotation"]),
        case(
            "affinity",
            "affinity:\n  nodeAffinity:\n    requiredDuringSchedulingIgnoredDuringExecution:\n      \
             nodeSelectorTerms:\n      - matchExpressions:\n        - {key: mesh, operator: In, values: ['true']}",
        ),
        case(
            "pod and DaemonSet metadata",
            "podAnnotations: {team: net, 'example.com/x': 'y'}\npodLabels: {team: net}\ndaemonSetLabels: {tier: node}",
        ),
        case(
            "env",
            "env: {FORCE_IPTABLES_BINARY: nft, DRIFT_CHECK_INTERVAL_SECONDS: 60, SOME_FLAG: true}",
        ),
        case(
            "updateStrategy",
            "updateStrategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: 10%}}",
        ),
        case("terminationGracePeriodSeconds", "terminationGracePeriodSeconds: 90"),
        case(
            "terminationGracePeriodSeconds 0",
            "terminationGracePeriodSeconds: 0",
        ),
        case(
            "resourceQuotas",
            "resourceQuotas: {enabled: true, pods: 100}",
        ),
        case(
            "global.networkPolicy",
            "global: {networkPolicy: {enabled: true}}",
        ),
        case(
            "global.networkPolicy with revision",
            "global: {networkPolicy: {enabled: true}}\nrevision: canary",
        ),
        case("networkPolicy at the top", "networkPolicy: {enabled: true}")
            .warns(&["networkPolicy"]),
        case(
            "resourceScope cluster",
            "global: {resourceScope: cluster, networkPolicy: {enabled: true}}\nambient: {enabled: true}",
        ),
        case(
            "resourceScope namespace",
            "global: {resourceScope: namespace, networkPolicy: {enabled: true}}\nresourceQuotas: {enabled: true}\nprovider: multus",
        ),
        case("revision and ownerName", "revision: canary\nownerName: my-iop"),
        // Strings Istio's templates write unquoted: all digits, they become numbers.
        case(
            "all-digit revision and ownerName",
            "revision: '123'\nownerName: '456'",
        ),
        case("all-digit cniConfFileName", "cniConfFileName: '10'"),
        case("env value with a quote", "env: {GREETING: 'say \"hi\"'}"),
        case("global.nativeNftables", "global: {nativeNftables: true}"),
        case("privileged", "privileged: true").warns(&["privileged"]),
        // Nulls clear a value.
        case("tolerations null", "tolerations: null"),
        case("excludeNamespaces null", "excludeNamespaces: null"),
        case("resources null", "resources: null"),
        case(
            "resources null with global.defaultResources",
            "resources: null\nglobal: {defaultResources: {requests: {cpu: 5m, memory: 5Mi}}}",
        ),
        case("requests.cpu null", "resources: {requests: {cpu: null}}"),
        case(
            "limits with a null",
            "resources: {limits: {cpu: null, memory: 1Gi}}",
        ),
        case(
            "all resources null",
            "resources: {requests: {cpu: null, memory: null}}",
        ),
        case(
            "no resources at all",
            "resources: null\nglobal: {defaultResources: null}",
        ),
        case("affinity null", "affinity: null"),
        case("updateStrategy null", "updateStrategy: null"),
        case("podAnnotations null", "podAnnotations: null"),
        case("env null", "env: null"),
        case("seLinuxOptions null", "seLinuxOptions: null"),
        case("cni.tolerations null", "cni: {tolerations: null}"),
        case("cni null", "cni: null"),
        case(
            "openshift seLinuxOptions null",
            "global: {platform: openshift}\nseLinuxOptions: null",
        ),
        // Keys of Istio's other charts in the same values file.
        case(
            "other charts' keys",
            "defaultRevision: canary\nrevisionTags: [prod]\nbase: {enableCRDTemplates: false}\n\
             sidecarInjectorWebhook: {enableNamespacesByDefault: true}\nistio_cni: {enabled: true}\n\
             pilot: {env: {PILOT_ENABLE_AMBIENT: 'true'}, cni: {enabled: true}}\n\
             meshConfig: {accessLogFile: /dev/stdout}\nztunnel: {resources: {requests: {cpu: 1m}}}\n\
             gateways: {istio-ingressgateway: {enabled: false}}\ntelemetry: {enabled: false}\n\
             istiodRemote: {enabled: false}\nexperimental: {stableValidationPolicy: true}\n\
             trustedZtunnelNamespace: kube-system\nconfigMap: false",
        ),
        case(
            "global keys of other charts",
            "global:\n  meshID: mesh1\n  network: net1\n  multiCluster: {clusterName: c1}\n  \
             istioNamespace: istio-system\n  proxy: {resources: {requests: {cpu: 1m}}}\n  \
             omitSidecarInjectorConfigMap: true\n  istiod: {enableAnalysis: true}",
        ),
        // Keys of older chart versions.
        case("cni.logLevel", "cni: {logLevel: debug}").warns(&["cni.logLevel"]),
        case("logLevel", "logLevel: debug").warns(&["logLevel"]),
        case("rollingMaxUnavailable", "rollingMaxUnavailable: 3")
            .warns(&["rollingMaxUnavailable"]),
        case("cni.rollingMaxUnavailable", "cni: {rollingMaxUnavailable: 3}")
            .warns(&["cni.rollingMaxUnavailable"]),
        case("cni.enabled=false", "cni: {enabled: false}").warns(&["cni.enabled"]),
        case("cni.enabled=true", "cni: {enabled: true}").warns(&["cni.enabled"]),
        case("cni.privileged", "cni: {privileged: true}").warns(&["cni.privileged"]),
        case(
            "cni.psp_cluster_role",
            "cni: {psp_cluster_role: psp-privileged}",
        )
        .warns(&["cni.psp_cluster_role"]),
        case("ambient.redirectMode", "ambient: {enabled: true, redirectMode: ebpf}")
            .warns(&["ambient.redirectMode"]),
        case(
            "cni.resource_quotas",
            "cni: {resource_quotas: {enabled: true, pods: 10}}",
        )
        .warns(&["cni.resource_quotas"]),
        case("typo ambient.enabeld", "ambient: {enabeld: true}")
            .warns(&["ambient.enabeld"]),
        case("ambient.configDir", "ambient: {configDir: /etc/ambient-config}")
            .warns(&["ambient.configDir"]),
        case("repair hub and tag", "repair: {hub: example.com/r, tag: r1}")
            .warns(&["repair.hub", "repair.tag"]),
        case("defaults empty", "defaults: {}"),
        case("defaults set", "defaults: {hub: example.com}"),
        case("cni not a map", "cni: 5"),
        case("ambient null", "ambient: null"),
        // A profile's (or platform's, or version's) `cni.` value and the user's own value.
        case(
            "profile=ambient, ambient.enabled=false",
            "profile: ambient\nambient: {enabled: false}",
        )
        .warns(&["ambient.enabled"]),
        case(
            "profile=ambient, cni.ambient.enabled=false",
            "profile: ambient\ncni: {ambient: {enabled: false}}",
        ),
        case(
            "profile=ambient, ambient.enabled=true",
            "profile: ambient\nambient: {enabled: true}",
        ),
        case(
            "openshift, chained=true",
            "global: {platform: openshift}\nchained: true",
        )
        .warns(&["chained"]),
        case(
            "openshift, provider and file name",
            "global: {platform: openshift}\nprovider: default\ncniConfFileName: 00-multus.conf",
        )
        .warns(&["provider", "cniConfFileName"]),
        case(
            "openshift, seLinuxOptions.type",
            "global: {platform: openshift}\nseLinuxOptions: {type: container_t}",
        ),
        case(
            "demo, resources.requests.cpu",
            "profile: demo\nresources: {requests: {cpu: 50m}}",
        )
        .warns(&["resources.requests.cpu"]),
        case(
            "demo, cni.resources.requests.cpu",
            "profile: demo\ncni: {resources: {requests: {cpu: 50m}}}",
        ),
        case(
            "gke, cniBinDir",
            "global: {platform: gke}\ncniBinDir: /custom/bin",
        )
        .warns(&["cniBinDir"]),
        case(
            "gke, cni.cniBinDir",
            "global: {platform: gke}\ncni: {cniBinDir: /custom/bin}",
        ),
        case(
            "gke, resourceQuotas.enabled=false",
            "global: {platform: gke}\nresourceQuotas: {enabled: false}",
        )
        .warns(&["resourceQuotas.enabled"]),
        case(
            "k3s, cniConfDir",
            "global: {platform: k3s}\ncniConfDir: /etc/cni/net.d",
        )
        .warns(&["cniConfDir"]),
        case(
            "1.26, reconcileIptablesOnStartup=true",
            "compatibilityVersion: '1.26'\nambient: {enabled: true, reconcileIptablesOnStartup: true}",
        )
        .warns(&["ambient.reconcileIptablesOnStartup"]),
        case(
            "1.25, shareHostNetworkNamespace=false",
            "compatibilityVersion: '1.25'\nambient: {enabled: true, shareHostNetworkNamespace: false}",
        ),
        case(
            "ambient profile, same values",
            "profile: ambient\nambient: {enabled: true}\nchained: true",
        ),
        // `cni.profile`, `cni.platform`, `cni.compatibilityVersion`: Istio reads them only at the top.
        case("cni.profile", "cni: {profile: ambient}").warns(&["cni.profile"]),
        case("cni.platform", "cni: {platform: k3s}").warns(&["cni.platform"]),
        case("cni.platform=openshift", "cni: {platform: openshift}")
            .warns(&["cni.platform"]),
        case(
            "cni.compatibilityVersion",
            "cni: {compatibilityVersion: '1.25', ambient: {enabled: true}}",
        )
        .warns(&["cni.compatibilityVersion"]),
        case(
            "cni.global.platform",
            "cni: {global: {platform: openshift}}",
        )
        .warns(&["cni.global.platform"]),
        // Release namespace.
        case("numeric namespace", "").namespace("12345"),
        case("kube-system", "profile: ambient").namespace("kube-system"),
        // Image variants.
        case("global.variant=distroless", "global: {variant: distroless}"),
        case("global.variant=debug", "global: {variant: debug}"),
        case("variant=distroless", "variant: distroless"),
        case(
            "variant beats global.variant",
            "variant: debug\nglobal: {variant: distroless}",
        ),
        case(
            "profile=ambient, variant cleared",
            "profile: ambient\nglobal: {variant: ''}",
        ),
        case(
            "variant with a full image",
            "image: example.com/x/install-cni:1\nglobal: {variant: distroless}",
        ),
        // Images under our local default hub, never pulled (imported into the nodes), or named
        // in full.
        case("imagePullPolicy=Never", "global: {imagePullPolicy: Never}"),
        case("pullPolicy=Never", "pullPolicy: Never"),
        case(
            "full image under the local hub",
            "image: localhost/istio-cni-rs/install-cni:1\nglobal: {hub: example.com/x}",
        ),
        case(
            "profile=ambient with tag",
            "profile: ambient\nglobal: {hub: docker.io/istio, tag: 1.28.0}",
        ),
        // What helm install sees: the cluster's own version.
        case("GKE cluster", "").kube(Kube::Cluster("v1.30.5-gke.1014001")),
        case("GKE cluster, platform=gke", "global: {platform: gke}")
            .kube(Kube::Cluster("v1.30.5-gke.1014001")),
        case(
            "GKE cluster, platform=gke, cniBinDir",
            "global: {platform: gke}\ncniBinDir: /custom/bin",
        )
        .kube(Kube::Cluster("v1.30.5-gke.1014001"))
        .warns(&["cniBinDir"]),
        case("GKE cluster, cniBinDir empty", "cniBinDir: ''")
            .kube(Kube::Cluster("v1.30.5-gke.1014001")),
        case("non-GKE cluster", "").kube(Kube::Cluster("v1.33.1")),
    ]);
    m
}

// ---------------------------------------------------------------------------------------------
// Rendering.

/// Stub APIs by reported version, started on first use.
struct Stubs(Mutex<BTreeMap<String, &'static FakeCluster>>);

impl Stubs {
    fn get(&self, git_version: &str) -> &'static FakeCluster {
        let mut map = self.0.lock().unwrap();
        map.entry(git_version.to_string())
            .or_insert_with(|| Box::leak(Box::new(FakeCluster::start(git_version))))
    }
}

fn run_helm(helm: &Path, args: &[String]) -> Result<String, String> {
    let out = Command::new(helm)
        .args(args)
        .env(
            "HELM_CACHE_HOME",
            std::env::temp_dir().join("chart-conformance-helm"),
        )
        .output()
        .expect("run helm");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(err.lines().next().unwrap_or("").trim().to_string())
    }
}

fn values_args(charts: &Charts, case: &Case, file: &Path) -> Vec<String> {
    let values = match case.values {
        Values::Yaml(yaml) => {
            std::fs::write(file, yaml).unwrap();
            file.to_path_buf()
        }
        Values::IstioProfileFile(name) => charts.istio_profiles.join(name),
    };
    vec![
        "--namespace".into(),
        case.namespace.into(),
        "-f".into(),
        values.to_str().unwrap().into(),
    ]
}

/// `helm template` of one chart: the objects, or the first line of helm's error.
fn template(
    charts: &Charts,
    chart: &Path,
    case: &Case,
    file: &Path,
    stubs: &Stubs,
) -> Result<Vec<Value>, String> {
    let mut args = vec![
        "template".to_string(),
        RELEASE.into(),
        chart.to_str().unwrap().into(),
    ];
    args.extend(values_args(charts, case, file));
    match case.kube {
        Kube::Default => {}
        Kube::Version(v) => args.extend(["--kube-version".into(), v.into()]),
        Kube::Cluster(v) => args.extend([
            "--validate".into(),
            "--disable-openapi-validation".into(),
            "--kubeconfig".into(),
            stubs.get(v).kubeconfig().into(),
        ]),
    }
    let out = run_helm(&charts.helm, &args)?;
    Ok(parse_objects(&out))
}

/// helm's output, split at its `---` lines; documents that hold only comments are dropped.
fn parse_objects(manifest: &str) -> Vec<Value> {
    let mut docs = vec![String::new()];
    for line in manifest.lines() {
        if line == "---" {
            docs.push(String::new());
        } else {
            let doc = docs.last_mut().unwrap();
            doc.push_str(line);
            doc.push('\n');
        }
    }
    docs.iter()
        .map(|doc| {
            serde_yaml::from_str::<Value>(doc)
                .unwrap_or_else(|e| panic!("helm printed invalid YAML ({e}):\n{doc}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// The `WARNING:` lines of our chart's NOTES, from `helm install --dry-run` (which also has
/// helm decode every object, as an install would).
fn our_warnings(
    charts: &Charts,
    case: &Case,
    file: &Path,
    stubs: &Stubs,
) -> Result<Vec<String>, String> {
    let version = match case.kube {
        Kube::Default => "v1.34.0",
        Kube::Version(v) => &format!("v{v}"),
        Kube::Cluster(v) => v,
    };
    let mut args = vec![
        "install".to_string(),
        RELEASE.into(),
        charts.ours.to_str().unwrap().into(),
        "--dry-run=client".into(),
        "--disable-openapi-validation".into(),
        "--kubeconfig".into(),
        stubs.get(version).kubeconfig().into(),
    ];
    args.extend(values_args(charts, case, file));
    let out = run_helm(&charts.helm, &args)?;
    let notes = out.split_once("\nNOTES:\n").map(|(_, n)| n).unwrap_or("");
    Ok(notes
        .lines()
        .filter(|l| l.starts_with("WARNING:"))
        .map(str::to_string)
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Comparison.

fn object_id(o: &Value) -> String {
    let kind = o["kind"].as_str().unwrap_or("?");
    let name = o["metadata"]["name"].as_str().unwrap_or("?");
    match &o["metadata"]["namespace"] {
        Value::Null => format!("{kind} {name}"),
        ns => format!(
            "{kind} {}/{name}",
            ns.as_str().map_or(ns.to_string(), str::to_string)
        ),
    }
}

fn show(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "(absent)".to_string(),
        Some(v) => v.to_string(),
    }
}

fn present(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_null())
}

/// Items keyed by their `name` when every item has a unique one.
fn by_name(items: &[Value]) -> Option<BTreeMap<&str, &Value>> {
    let mut map = BTreeMap::new();
    for item in items {
        let name = item.get("name")?.as_str()?;
        if map.insert(name, item).is_some() {
            return None;
        }
    }
    Some(map)
}

struct Images<'a> {
    istio_hub: &'a str,
    our_hub: &'a str,
}

/// An image reference split into repository and tag.
fn split_image(image: &str) -> (&str, &str) {
    let slash = image.rfind('/').map_or(0, |i| i + 1);
    match image[slash..].rfind(':') {
        Some(i) => (&image[..slash + i], &image[slash + i + 1..]),
        None => (image, ""),
    }
}

impl Images<'_> {
    /// The image rule (see the module comment): Istio's default hub read as ours, then equal.
    fn conform(&self, istio: &str, ours: &str) -> bool {
        let (istio_repo, istio_tag) = split_image(istio);
        let istio_repo = match istio_repo.strip_prefix(&format!("{}/", self.istio_hub)) {
            Some(rest) => format!("{}/{rest}", self.our_hub),
            None => istio_repo.to_string(),
        };
        (istio_repo.as_str(), istio_tag) == split_image(ours)
    }
}

fn diff_value(
    path: &str,
    istio: Option<&Value>,
    ours: Option<&Value>,
    images: &Images<'_>,
    out: &mut Vec<String>,
) {
    let (istio, ours) = (present(istio), present(ours));
    let differ = || format!("{path}: Istio {} | ours {}", show(istio), show(ours));
    match (istio, ours) {
        (None, None) => {}
        (Some(Value::Object(a)), Some(Value::Object(b))) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                diff_value(&format!("{path}.{k}"), a.get(k), b.get(k), images, out);
            }
        }
        (Some(Value::Array(a)), Some(Value::Array(b))) => {
            if let (Some(a), Some(b)) = (by_name(a), by_name(b)) {
                let keys: BTreeSet<&&str> = a.keys().chain(b.keys()).collect();
                for k in keys {
                    let (x, y) = (a.get(*k).copied(), b.get(*k).copied());
                    diff_value(&format!("{path}[{k}]"), x, y, images, out);
                }
            } else {
                for i in 0..a.len().max(b.len()) {
                    diff_value(&format!("{path}[{i}]"), a.get(i), b.get(i), images, out);
                }
            }
        }
        (Some(Value::String(a)), Some(Value::String(b)))
            if path.contains(".containers[") && path.ends_with("].image") =>
        {
            if !images.conform(a, b) {
                out.push(differ());
            }
        }
        (a, b) if a == b => {}
        _ => out.push(differ()),
    }
}

/// Every difference between two renders, one line each.
fn diff_renders(
    istio: &Result<Vec<Value>, String>,
    ours: &Result<Vec<Value>, String>,
    images: &Images<'_>,
) -> Vec<String> {
    let (istio, ours) = match (istio, ours) {
        (Err(_), Err(_)) => return Vec::new(),
        (Err(e), Ok(_)) => {
            return vec![format!("render: Istio's chart fails ({e}) | ours renders")];
        }
        (Ok(_), Err(e)) => {
            return vec![format!("render: Istio's chart renders | ours fails ({e})")];
        }
        (Ok(a), Ok(b)) => (a, b),
    };
    let index = |objs: &[Value]| -> BTreeMap<String, Value> {
        let mut map = BTreeMap::new();
        for o in objs {
            assert!(
                map.insert(object_id(o), o.clone()).is_none(),
                "{} rendered twice",
                object_id(o)
            );
        }
        map
    };
    let (a, b) = (index(istio), index(ours));
    let mut out = Vec::new();
    for id in a.keys().chain(b.keys()).collect::<BTreeSet<_>>() {
        match (a.get(id), b.get(id)) {
            (Some(_), None) => out.push(format!("{id}: only in Istio's")),
            (None, Some(_)) => out.push(format!("{id}: only in ours")),
            (Some(x), Some(y)) => {
                let mut lines = Vec::new();
                diff_value("", Some(x), Some(y), images, &mut lines);
                out.extend(lines.into_iter().map(|l| format!("{id} {l}")));
            }
            (None, None) => unreachable!(),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The allowlist.

struct Allowed {
    case: String,
    difference: String,
}

/// The entries under our key (other keys belong to other tests): each exactly `case`,
/// `difference` and a non-empty `why`.
fn allowlist() -> Vec<Allowed> {
    let path = repo_root().join(ALLOWLIST);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file: Value = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{ALLOWLIST}: {e}"));
    let entries = match &file[ALLOWLIST_KEY] {
        Value::Null => return Vec::new(),
        Value::Array(entries) => entries,
        other => panic!("{ALLOWLIST}: `{ALLOWLIST_KEY}` must be a list, not {other}"),
    };
    entries
        .iter()
        .map(|e| {
            let field = |k: &str| -> String {
                match e.get(k).and_then(Value::as_str) {
                    Some(v) if !v.trim().is_empty() => v.to_string(),
                    _ => panic!("{ALLOWLIST}: {ALLOWLIST_KEY} entry {e} needs a non-empty `{k}`"),
                }
            };
            let keys: BTreeSet<&str> = e
                .as_object()
                .map(|o| o.keys().map(String::as_str).collect())
                .unwrap_or_default();
            assert_eq!(
                keys,
                BTreeSet::from(["case", "difference", "why"]),
                "{ALLOWLIST}: {ALLOWLIST_KEY} entry {e}"
            );
            field("why");
            Allowed {
                case: field("case"),
                difference: field("difference"),
            }
        })
        .collect()
}

/// `*` matches any run of characters, everything else itself.
fn glob(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !text.starts_with(first) || text.len() < first.len() + last.len() || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

// ---------------------------------------------------------------------------------------------
// The tests.

struct Outcome {
    differences: Vec<String>,
    /// Our NOTES' warnings, or why `helm install --dry-run` failed; None when `helm template`
    /// of our chart failed already.
    warnings: Option<Result<Vec<String>, String>>,
    /// Our agent's image is under [`LOCAL_HUB`] and would be pulled.
    pulls_local_hub: bool,
    both_fail: bool,
}

/// Whether a render's agent image is under [`LOCAL_HUB`] with a pull policy that goes to a
/// registry (anything but `Never`).
fn pulls_local_hub(render: &Result<Vec<Value>, String>) -> bool {
    let Ok(objects) = render else { return false };
    objects
        .iter()
        .filter(|o| o["kind"] == "DaemonSet")
        .filter_map(|o| o["spec"]["template"]["spec"]["containers"].as_array())
        .flatten()
        .any(|c| {
            c["image"]
                .as_str()
                .is_some_and(|i| i.starts_with(LOCAL_HUB))
                && c["imagePullPolicy"] != "Never"
        })
}

fn run_matrix(charts: &Charts, cases: &[Case]) -> Vec<Outcome> {
    let stubs = Stubs(Mutex::new(BTreeMap::new()));
    let images = Images {
        istio_hub: &charts.istio_hub,
        our_hub: &charts.our_hub,
    };
    let dir = tempfile::tempdir().unwrap();
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<Outcome>>> = cases.iter().map(|_| Mutex::new(None)).collect();
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(2));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(case) = cases.get(i) else { break };
                    let file = dir.path().join(format!("case-{i}.yaml"));
                    let istio = template(charts, &charts.istio, case, &file, &stubs);
                    let ours = template(charts, &charts.ours, case, &file, &stubs);
                    let warnings = ours
                        .is_ok()
                        .then(|| our_warnings(charts, case, &file, &stubs));
                    *results[i].lock().unwrap() = Some(Outcome {
                        differences: diff_renders(&istio, &ours, &images),
                        warnings,
                        pulls_local_hub: pulls_local_hub(&ours),
                        both_fail: istio.is_err() && ours.is_err(),
                    });
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().unwrap().unwrap())
        .collect()
}

#[test]
fn our_chart_renders_what_istios_renders() {
    dataplane::enter_test_group!();
    let charts = Charts::prepare();
    let cases = matrix();
    let mut names = BTreeSet::new();
    for c in &cases {
        assert!(names.insert(c.name), "case {:?} twice", c.name);
    }
    let outcomes = run_matrix(&charts, &cases);
    let allowed = allowlist();
    let mut used = vec![0usize; allowed.len()];
    let mut unexplained: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut warning_failures = Vec::new();
    let mut total = 0;
    for (case, outcome) in cases.iter().zip(&outcomes) {
        total += outcome.differences.len();
        for d in &outcome.differences {
            let mut matched = false;
            for (i, a) in allowed.iter().enumerate() {
                if glob(&a.case, case.name) && glob(&a.difference, d) {
                    used[i] += 1;
                    matched = true;
                }
            }
            if !matched {
                unexplained.entry(case.name).or_default().push(d.clone());
            }
        }
        // NOTES: each expected warning on a line of its own, and no other warning.
        let warnings = match &outcome.warnings {
            Some(Ok(w)) => w.as_slice(),
            Some(Err(e)) => {
                warning_failures.push(format!(
                    "case {:?}: helm install --dry-run of our chart fails: {e}",
                    case.name
                ));
                continue;
            }
            None if case.warns.is_empty() => continue,
            None => {
                warning_failures.push(format!(
                    "case {:?}: expects NOTES warnings, but our chart fails to render",
                    case.name
                ));
                continue;
            }
        };
        let mut wanted = case.warns.clone();
        if outcome.pulls_local_hub {
            wanted.push(LOCAL_HUB_WARNING);
        }
        let mut expected_lines = BTreeSet::new();
        for want in &wanted {
            match warnings.iter().position(|l| l.contains(want)) {
                Some(i) => {
                    expected_lines.insert(i);
                }
                None => warning_failures.push(format!(
                    "case {:?}: no NOTES warning mentions {want:?} (warnings: {warnings:?})",
                    case.name
                )),
            }
        }
        for (i, line) in warnings.iter().enumerate() {
            if !expected_lines.contains(&i) {
                warning_failures.push(format!("case {:?}: unexpected NOTES {line:?}", case.name));
            }
        }
    }
    eprintln!(
        "chart conformance: {} cases ({} fail to render in both charts), {total} differences, {} allowlisted",
        cases.len(),
        outcomes.iter().filter(|o| o.both_fail).count(),
        used.iter().sum::<usize>()
    );
    let mut report = String::new();
    if !unexplained.is_empty() {
        report += &format!(
            "differences from Istio's chart that are not under `{ALLOWLIST_KEY}:` in {ALLOWLIST}:\n"
        );
        for (case, lines) in &unexplained {
            report += &format!("  case {case:?}:\n");
            for l in lines {
                report += &format!("    {l}\n");
            }
        }
    }
    let stale: Vec<&Allowed> = allowed
        .iter()
        .zip(&used)
        .filter(|(_, n)| **n == 0)
        .map(|(a, _)| a)
        .collect();
    if !stale.is_empty() {
        report += &format!("stale entries in {ALLOWLIST} (they match no difference any more):\n");
        for a in stale {
            report += &format!("  case {:?} difference {:?}\n", a.case, a.difference);
        }
    }
    for f in &warning_failures {
        report += &format!("{f}\n");
    }
    assert!(report.is_empty(), "\n{report}");
}

/// The comparison itself: it sees a changed, a missing and an extra field, tells null from a
/// value, keys named lists by name, and applies the image rule.
#[test]
fn the_comparison_sees_what_differs() {
    dataplane::enter_test_group!();
    let images = Images {
        istio_hub: "registry.istio.io/testing",
        our_hub: "localhost/istio-cni-rs",
    };
    let ds = |image: &str, env: Value, extra: Value| -> Value {
        json!({"kind": "DaemonSet", "metadata": {"name": "istio-cni-node", "namespace": "ns"},
               "spec": {"template": {"spec": {"containers": [{"name": "install-cni",
               "image": image, "env": env}], "tolerations": extra}}}})
    };
    let istio = ds(
        "registry.istio.io/testing/install-cni:1.28.0-distroless",
        json!([{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]),
        json!([{"operator": "Exists"}]),
    );
    let same = ds(
        "localhost/istio-cni-rs/install-cni:1.28.0-distroless",
        json!([{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]),
        json!([{"operator": "Exists"}]),
    );
    assert_eq!(
        diff_renders(&Ok(vec![istio.clone()]), &Ok(vec![same]), &images),
        Vec::<String>::new()
    );
    let other = ds(
        "localhost/istio-cni-rs/install-cni:1.28.0",
        json!([{"name": "A", "value": "9"}, {"name": "C", "value": "3"}]),
        Value::Null,
    );
    let mut got = diff_renders(&Ok(vec![istio.clone()]), &Ok(vec![other]), &images);
    got.sort();
    let id = "DaemonSet ns/istio-cni-node .spec.template.spec";
    assert_eq!(
        got,
        vec![
            format!("{id}.containers[install-cni].env[A].value: Istio \"1\" | ours \"9\""),
            format!(
                "{id}.containers[install-cni].env[B]: Istio {{\"name\":\"B\",\"value\":\"2\"}} | ours (absent)"
            ),
            format!(
                "{id}.containers[install-cni].env[C]: Istio (absent) | ours {{\"name\":\"C\",\"value\":\"3\"}}"
            ),
            format!(
                "{id}.containers[install-cni].image: Istio \"registry.istio.io/testing/install-cni:1.28.0-distroless\" | ours \"localhost/istio-cni-rs/install-cni:1.28.0\""
            ),
            format!("{id}.tolerations: Istio [{{\"operator\":\"Exists\"}}] | ours (absent)"),
        ]
    );
    // A number is not the string of it (an unquoted all-digit namespace).
    let a = json!({"kind": "ServiceAccount", "metadata": {"name": "x", "namespace": "12345"}});
    let b = json!({"kind": "ServiceAccount", "metadata": {"name": "x", "namespace": 12345}});
    assert_eq!(
        diff_renders(&Ok(vec![a.clone()]), &Ok(vec![b]), &images),
        vec!["ServiceAccount 12345/x .metadata.namespace: Istio \"12345\" | ours 12345"]
    );
    assert_eq!(
        diff_renders(&Ok(vec![a.clone()]), &Ok(vec![]), &images),
        vec!["ServiceAccount 12345/x: only in Istio's"]
    );
    assert!(diff_renders(&Err("x".into()), &Err("y".into()), &images).is_empty());
    assert_eq!(
        diff_renders(&Err("boom".into()), &Ok(vec![a]), &images),
        vec!["render: Istio's chart fails (boom) | ours renders"]
    );
    // Another hub is compared as is.
    assert!(images.conform("example.com/x/install-cni:1", "example.com/x/install-cni:1"));
    assert!(!images.conform("example.com/x/install-cni:1", "example.com/y/install-cni:1"));
    assert!(images.conform(
        "example.com:5000/install-cni:1-debug",
        "example.com:5000/install-cni:1-debug"
    ));
    assert!(!images.conform(
        "example.com:5000/install-cni:1-debug",
        "example.com:5000/install-cni:1"
    ));
}

#[test]
fn allowlist_globs() {
    dataplane::enter_test_group!();
    assert!(glob("*", ""));
    assert!(glob("a*c", "abc"));
    assert!(glob("a*c", "ac"));
    assert!(!glob("a*c", "abd"));
    assert!(glob(
        "*.env[GOMEMLIMIT]*",
        "DaemonSet x .spec.env[GOMEMLIMIT]: Istio 1 | ours (absent)"
    ));
    assert!(!glob("ab*ba", "aba"));
    assert!(glob("exact", "exact"));
    assert!(!glob("exact", "exactly"));
    // The file parses, and this test's key holds only well-formed entries.
    allowlist();
}
