//! The shipped manifests (`deploy/manifests/*.yaml`, rendered from the Helm chart) applied to a
//! test API server the way `kubectl apply --server-side` applies them: each document's kind is
//! resolved through discovery, unknown fields are rejected.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::discovery::Scope;
use serde::Deserialize;

use super::kube::KubeTestEnv;

/// Namespace the manifests are rendered for.
pub const NAMESPACE: &str = "istio-system";
/// The agent's ServiceAccount in the manifests.
pub const SERVICE_ACCOUNT: &str = "istio-cni";

/// A file of the repository (e.g. `deploy/manifests/istio-cni-ambient.yaml`).
pub fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// The helm binary built from its Go module by `tools/helm/build.sh` (cached; built on first use).
pub fn helm() -> &'static Path {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| built_tool("tools/helm/build.sh"))
}

/// Runs one of the repository's `tools/*/build.sh` (which build a pinned Go module once and
/// cache it) and returns the binary's path, the last line it prints.
pub fn built_tool(script: &str) -> PathBuf {
    let script = repo_file(script);
    let out = Command::new(&script)
        .stderr(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    let stdout = String::from_utf8(out.stdout).expect("build.sh prints a path");
    PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("build.sh prints the binary")
            .trim(),
    )
}

/// `helm template` of our chart into [`NAMESPACE`] with extra arguments (`-f`, `--set`): the
/// objects, or helm's error output.
pub fn try_render_chart(args: &[&str]) -> Result<Vec<DynamicObject>, String> {
    let out = Command::new(helm())
        .args(["template", "istio-cni"])
        .arg(repo_file("deploy/charts/istio-cni"))
        .args(["--namespace", NAMESPACE])
        .args(args)
        .output()
        .expect("run helm");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(documents(
        &String::from_utf8(out.stdout).expect("helm prints YAML"),
    ))
}

/// [`try_render_chart`], panicking with helm's error output.
pub fn render_chart(args: &[&str]) -> Vec<DynamicObject> {
    try_render_chart(args).unwrap_or_else(|e| panic!("helm template {args:?}: {e}"))
}

/// The documents of a multi-document YAML stream; empty documents are skipped.
pub fn documents(yaml: &str) -> Vec<DynamicObject> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| serde_json::Value::deserialize(doc).expect("manifest is YAML"))
        .filter(|v| !v.is_null())
        .map(|v| serde_json::from_value(v).expect("manifest document is a Kubernetes object"))
        .collect()
}

/// Reads a file of `deploy/manifests/`.
pub fn shipped(name: &str) -> Vec<DynamicObject> {
    let path = repo_file(&format!("deploy/manifests/{name}"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/render-manifests)", path.display()));
    documents(&text)
}

pub fn kind(obj: &DynamicObject) -> &str {
    obj.types.as_ref().map(|t| t.kind.as_str()).unwrap_or("")
}

/// Server-side apply of one object (a dry run when `dry_run`: validated and admitted, not stored).
pub async fn apply(
    client: &kube::Client,
    obj: &DynamicObject,
    dry_run: bool,
) -> Result<DynamicObject, kube::Error> {
    let types = obj.types.as_ref().expect("object has apiVersion and kind");
    let gvk = GroupVersionKind::try_from(types).expect("valid apiVersion");
    let (resource, caps) = kube::discovery::pinned_kind(client, &gvk).await?;
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Namespaced => Api::namespaced_with(
            client.clone(),
            obj.metadata.namespace.as_deref().unwrap_or("default"),
            &resource,
        ),
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    };
    let mut params = PatchParams::apply("istio-cni-rs-tests")
        .force()
        .validation_strict();
    if dry_run {
        params = params.dry_run();
    }
    let name = obj.metadata.name.as_deref().expect("object has a name");
    api.patch(name, &params, &Patch::Apply(obj)).await
}

pub async fn ensure_namespace(client: &kube::Client, name: &str) {
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).expect("namespace");
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create namespace {name}: {e}"),
    }
}

/// Installs the ServiceAccount, ClusterRoles and ClusterRoleBindings of the ambient manifest and
/// returns a token of that ServiceAccount: whoever uses it has exactly the shipped rights.
pub async fn install_shipped_rbac(kube: &KubeTestEnv) -> String {
    let admin = kube.client();
    ensure_namespace(&admin, NAMESPACE).await;
    for obj in shipped("istio-cni-ambient.yaml") {
        if matches!(
            kind(&obj),
            "ServiceAccount" | "ClusterRole" | "ClusterRoleBinding"
        ) {
            apply(&admin, &obj, false)
                .await
                .unwrap_or_else(|e| panic!("apply {} {:?}: {e}", kind(&obj), obj.metadata.name));
        }
    }
    kube.service_account_client(NAMESPACE, SERVICE_ACCOUNT)
        .await
        .1
}
