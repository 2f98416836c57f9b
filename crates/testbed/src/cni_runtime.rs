//! A CNI runtime emulator: runs a config list's real plugin binaries the way containerd (through
//! libcni) does, so tests exercise our plugin inside a real chain instead of calling it alone.
//!
//! What libcni does and this reproduces:
//! - ADD runs the plugins in list order. Each gets `CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`,
//!   `CNI_IFNAME`, `CNI_ARGS`, `CNI_PATH` (the plugin dirs, `:`-joined) on top of the runtime's
//!   own environment, and on stdin its own config object with the list's `name` and `cniVersion`
//!   injected, the previous plugin's result as `prevResult` (none for the first), and
//!   `runtimeConfig` holding the runtime's values for the capabilities the plugin declares.
//!   The last plugin's result is the sandbox's result.
//! - DEL runs them in reverse order; from spec 0.4.0 on each gets the cached ADD result as
//!   `prevResult`. CHECK (0.4.0+) runs them in order, each with the cached result.
//! - A plugin that exits non-zero failed; its stdout is the CNI error object.
//!
//! Plugins can run inside a "node" network namespace (the runtime's own), entered between fork
//! and exec, so a test never changes the host's network.

#![allow(
    clippy::result_large_err,
    reason = "test kit: a failure carries the plugin's whole output, and failures are rare"
)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use cni_core::cni::CniError;
use dataplane::netns::Netns;
use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum CniRuntimeError {
    #[error("invalid conflist: {0}")]
    Conflist(String),
    #[error("plugin {plugin_type:?} not found in {dirs:?}")]
    PluginNotFound {
        plugin_type: String,
        dirs: Vec<PathBuf>,
    },
    #[error("cannot run plugin {plugin_type:?}: {source}")]
    Exec {
        plugin_type: String,
        source: std::io::Error,
    },
    /// The plugin exited non-zero; `error` is what it printed.
    #[error("{command} failed in plugin #{index} {plugin_type:?}: {error} (stderr: {stderr})")]
    Plugin {
        command: String,
        index: usize,
        plugin_type: String,
        error: CniError,
        stderr: String,
    },
    #[error(
        "{command}: plugin {plugin_type:?} printed something that is not a CNI result/error: {stdout:?}"
    )]
    BadOutput {
        command: String,
        plugin_type: String,
        stdout: String,
    },
    #[error("{0} needs a conflist cniVersion of 0.4.0 or later")]
    Version(&'static str),
}

/// One pod sandbox's identity, as the runtime passes it.
#[derive(Clone, Debug)]
pub struct Sandbox {
    pub container_id: String,
    pub netns: PathBuf,
    pub ifname: String,
    /// `CNI_ARGS` pairs, in order.
    pub args: Vec<(String, String)>,
}

impl Sandbox {
    /// A Kubernetes pod sandbox, with the `CNI_ARGS` containerd's CRI plugin sends.
    pub fn k8s(
        container_id: &str,
        netns: impl Into<PathBuf>,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Sandbox {
        Sandbox {
            container_id: container_id.to_owned(),
            netns: netns.into(),
            ifname: "eth0".to_owned(),
            args: vec![
                ("IgnoreUnknown".into(), "1".into()),
                ("K8S_POD_NAMESPACE".into(), namespace.to_owned()),
                ("K8S_POD_NAME".into(), name.to_owned()),
                ("K8S_POD_INFRA_CONTAINER_ID".into(), container_id.to_owned()),
                ("K8S_POD_UID".into(), uid.to_owned()),
            ],
        }
    }

    /// A sandbox outside Kubernetes (no pod identity in `CNI_ARGS`).
    pub fn plain(container_id: &str, netns: impl Into<PathBuf>) -> Sandbox {
        Sandbox {
            container_id: container_id.to_owned(),
            netns: netns.into(),
            ifname: "eth0".into(),
            args: vec![],
        }
    }

    fn cni_args(&self) -> String {
        self.args
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";")
    }
}

/// What one plugin of a chain did.
#[derive(Clone, Debug)]
pub struct PluginRun {
    pub index: usize,
    pub plugin_type: String,
    pub stdin: Vec<u8>,
    /// Exactly what it printed.
    pub stdout: Vec<u8>,
    pub stderr: String,
}

pub struct CniRuntime {
    list: Map<String, Value>,
    plugins: Vec<Map<String, Value>>,
    plugin_dirs: Vec<PathBuf>,
    netns: Option<Netns>,
    runtime_config: Map<String, Value>,
}

impl CniRuntime {
    pub fn new(conflist: &str, plugin_dirs: Vec<PathBuf>) -> Result<CniRuntime, CniRuntimeError> {
        let v: Value =
            serde_json::from_str(conflist).map_err(|e| CniRuntimeError::Conflist(e.to_string()))?;
        let Value::Object(list) = v else {
            return Err(CniRuntimeError::Conflist("not an object".into()));
        };
        if list
            .get("name")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            return Err(CniRuntimeError::Conflist("no name".into()));
        }
        let plugins = match list.get("plugins") {
            Some(Value::Array(items)) if !items.is_empty() => items
                .iter()
                .map(|p| match p {
                    Value::Object(o)
                        if o.get("type")
                            .and_then(Value::as_str)
                            .is_some_and(|t| !t.is_empty()) =>
                    {
                        Ok(o.clone())
                    }
                    _ => Err(CniRuntimeError::Conflist(
                        "every plugin needs a type".into(),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => return Err(CniRuntimeError::Conflist("no plugins".into())),
        };
        Ok(CniRuntime {
            list,
            plugins,
            plugin_dirs,
            netns: None,
            runtime_config: Map::new(),
        })
    }

    /// Runs every plugin inside `netns` (the node's namespace in a test).
    pub fn in_netns(mut self, netns: Netns) -> Self {
        self.netns = Some(netns);
        self
    }

    /// A capability argument (e.g. `portMappings`), handed to plugins that declare it.
    pub fn with_runtime_config(mut self, capability: &str, value: Value) -> Self {
        self.runtime_config.insert(capability.to_owned(), value);
        self
    }

    pub fn cni_version(&self) -> &str {
        self.list
            .get("cniVersion")
            .and_then(Value::as_str)
            .unwrap_or("0.1.0")
    }

    pub fn add(&self, sandbox: &Sandbox) -> Result<Value, CniRuntimeError> {
        self.add_observed(sandbox, &mut |_| {})
    }

    /// ADD, calling `observe` after each plugin succeeded (to inspect the namespaces in between).
    pub fn add_observed(
        &self,
        sandbox: &Sandbox,
        observe: &mut dyn FnMut(&PluginRun),
    ) -> Result<Value, CniRuntimeError> {
        let result = self.add_plugins(sandbox, 0..self.plugins.len(), None, observe)?;
        Ok(result.expect("a list has at least one plugin"))
    }

    pub fn plugin_count(&self) -> usize {
        self.plugins.len()
    }

    /// Where the plugin of this type sits in the chain.
    pub fn position(&self, plugin_type: &str) -> Option<usize> {
        self.plugins
            .iter()
            .position(|p| p["type"].as_str() == Some(plugin_type))
    }

    /// ADD through the plugins in `range` only, the first of them getting `prev` as its
    /// `prevResult`: one chain run in two parts, so a benchmark can time a single plugin. Returns
    /// the last plugin's result (`prev` for an empty range).
    pub fn add_plugins(
        &self,
        sandbox: &Sandbox,
        range: std::ops::Range<usize>,
        mut prev: Option<Value>,
        observe: &mut dyn FnMut(&PluginRun),
    ) -> Result<Option<Value>, CniRuntimeError> {
        for index in range {
            let plugin = &self.plugins[index];
            let run = self.exec("ADD", index, plugin, sandbox, prev.as_ref())?;
            let result: Value =
                serde_json::from_slice(&run.stdout).map_err(|_| CniRuntimeError::BadOutput {
                    command: "ADD".into(),
                    plugin_type: run.plugin_type.clone(),
                    stdout: String::from_utf8_lossy(&run.stdout).into_owned(),
                })?;
            observe(&run);
            prev = Some(result);
        }
        Ok(prev)
    }

    /// DEL in reverse order with the cached ADD result (spec 0.4.0+).
    pub fn del(&self, sandbox: &Sandbox, cached: Option<&Value>) -> Result<(), CniRuntimeError> {
        let prev = if self.at_least_040() { cached } else { None };
        for (index, plugin) in self.plugins.iter().enumerate().rev() {
            self.exec("DEL", index, plugin, sandbox, prev)?;
        }
        Ok(())
    }

    /// CHECK in order with the cached ADD result.
    pub fn check(&self, sandbox: &Sandbox, cached: &Value) -> Result<(), CniRuntimeError> {
        if !self.at_least_040() {
            return Err(CniRuntimeError::Version("CHECK"));
        }
        for (index, plugin) in self.plugins.iter().enumerate() {
            self.exec("CHECK", index, plugin, sandbox, Some(cached))?;
        }
        Ok(())
    }

    fn at_least_040(&self) -> bool {
        cni_core::cni::version::at_least(self.cni_version(), "0.4.0").unwrap_or(false)
    }

    /// The stdin libcni builds for one plugin.
    pub fn plugin_stdin(&self, plugin: &Map<String, Value>, prev: Option<&Value>) -> Vec<u8> {
        let mut conf = plugin.clone();
        conf.insert("name".into(), self.list["name"].clone());
        conf.insert(
            "cniVersion".into(),
            Value::String(self.cni_version().to_owned()),
        );
        if let Some(prev) = prev {
            conf.insert("prevResult".into(), prev.clone());
        }
        let mut rc = Map::new();
        if let Some(Value::Object(caps)) = plugin.get("capabilities") {
            for (cap, enabled) in caps {
                if enabled.as_bool() == Some(true)
                    && let Some(v) = self.runtime_config.get(cap)
                {
                    rc.insert(cap.clone(), v.clone());
                }
            }
        }
        if !rc.is_empty() {
            conf.insert("runtimeConfig".into(), Value::Object(rc));
        }
        serde_json::to_vec(&Value::Object(conf)).expect("in memory")
    }

    fn find(&self, plugin_type: &str) -> Result<PathBuf, CniRuntimeError> {
        self.plugin_dirs
            .iter()
            .map(|d| d.join(plugin_type))
            .find(|p| is_executable(p))
            .ok_or_else(|| CniRuntimeError::PluginNotFound {
                plugin_type: plugin_type.to_owned(),
                dirs: self.plugin_dirs.clone(),
            })
    }

    fn exec(
        &self,
        command: &str,
        index: usize,
        plugin: &Map<String, Value>,
        sandbox: &Sandbox,
        prev: Option<&Value>,
    ) -> Result<PluginRun, CniRuntimeError> {
        let plugin_type = plugin["type"].as_str().expect("checked in new").to_owned();
        let path = self.find(&plugin_type)?;
        let stdin = self.plugin_stdin(plugin, prev);
        let cni_path = self
            .plugin_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(":");
        let mut cmd = Command::new(&path);
        // The runtime's own environment minus any CNI_* it happens to carry, then the CNI vars.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("CNI_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &sandbox.container_id)
            .env("CNI_NETNS", &sandbox.netns)
            .env("CNI_IFNAME", &sandbox.ifname)
            .env("CNI_ARGS", sandbox.cni_args())
            .env("CNI_PATH", cni_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let exec_err = |source| CniRuntimeError::Exec {
            plugin_type: plugin_type.clone(),
            source,
        };
        let mut child = match &self.netns {
            Some(ns) => ns.spawn(&mut cmd),
            None => cmd.spawn(),
        }
        .map_err(exec_err)?;
        // A plugin may exit without reading stdin (VERSION-like shortcuts): EPIPE is not an error.
        let _ = child.stdin.take().expect("piped").write_all(&stdin);
        let out = child.wait_with_output().map_err(exec_err)?;
        let run = PluginRun {
            index,
            plugin_type: plugin_type.clone(),
            stdin,
            stdout: out.stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        };
        if !out.status.success() {
            let error = serde_json::from_slice::<CniError>(&run.stdout).map_err(|_| {
                CniRuntimeError::BadOutput {
                    command: command.into(),
                    plugin_type: plugin_type.clone(),
                    stdout: String::from_utf8_lossy(&run.stdout).into_owned(),
                }
            })?;
            return Err(CniRuntimeError::Plugin {
                command: command.into(),
                index,
                plugin_type,
                error,
                stderr: run.stderr,
            });
        }
        Ok(run)
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn builds_stdin_like_libcni() {
        let rt = CniRuntime::new(
            r#"{"cniVersion":"1.0.0","name":"net","plugins":[
                {"type":"portmap","capabilities":{"portMappings":true,"bandwidth":false},"snat":true},
                {"type":"istio-cni","cniVersion":"0.3.1"}]}"#,
            vec![],
        )
        .unwrap()
        .with_runtime_config("portMappings", json!([{"hostPort": 80}]))
        .with_runtime_config("bandwidth", json!({"ingressRate": 1}));
        let first: Value = serde_json::from_slice(&rt.plugin_stdin(&rt.plugins[0], None)).unwrap();
        assert_eq!(
            first,
            json!({"type":"portmap","name":"net","cniVersion":"1.0.0","snat":true,
                   "capabilities":{"portMappings":true,"bandwidth":false},
                   "runtimeConfig":{"portMappings":[{"hostPort":80}]}})
        );
        // The list's version wins over a plugin's own; prevResult is passed as given.
        let prev = json!({"cniVersion":"1.0.0","ips":[]});
        let second: Value =
            serde_json::from_slice(&rt.plugin_stdin(&rt.plugins[1], Some(&prev))).unwrap();
        assert_eq!(
            second,
            json!({"type":"istio-cni","name":"net","cniVersion":"1.0.0","prevResult":prev})
        );
    }

    #[test]
    fn rejects_bad_lists() {
        for bad in [
            r#"[]"#,
            r#"{"plugins":[{"type":"x"}]}"#,
            r#"{"name":"n","plugins":[]}"#,
            r#"{"name":"n","plugins":[{}]}"#,
        ] {
            assert!(
                matches!(
                    CniRuntime::new(bad, vec![]),
                    Err(CniRuntimeError::Conflist(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn missing_plugin_is_reported() {
        let rt = CniRuntime::new(
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"nope"}]}"#,
            vec!["/nonexistent".into()],
        )
        .unwrap();
        let e = rt
            .add(&Sandbox::plain("c1", "/var/run/netns/x"))
            .unwrap_err();
        assert!(matches!(e, CniRuntimeError::PluginNotFound { .. }), "{e}");
        assert!(matches!(
            rt.check(&Sandbox::plain("c1", "/x"), &json!({})),
            Err(CniRuntimeError::PluginNotFound { .. })
        ));
    }

    #[test]
    fn old_lists_cannot_check() {
        let rt = CniRuntime::new(
            r#"{"cniVersion":"0.3.1","name":"n","plugins":[{"type":"x"}]}"#,
            vec![],
        )
        .unwrap();
        assert!(matches!(
            rt.check(&Sandbox::plain("c", "/x"), &json!({})),
            Err(CniRuntimeError::Version("CHECK"))
        ));
    }
}
