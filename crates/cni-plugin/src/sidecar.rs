//! Sidecar-mode redirection, which the plugin programs itself (Istio's replacement for the
//! privileged `istio-init` container): decide from the Pod object whether the pod is an
//! injected sidecar pod, then program its redirect rules inside `CNI_NETNS` with the backend the
//! config selects (`native_nftables`). Every failure fails the ADD with a message naming the pod,
//! and for a bad annotation value the annotation: a sidecar pod must never start unredirected.

use std::net::IpAddr;

use cni_core::cni::CniError;
use cni_core::plugin_conf::PluginConf;
use cni_core::redirect::sidecar::{self, Detection};
use dataplane::netns::Netns;
use dataplane::sidecar::SidecarBackend;
use serde_json::Value;

use crate::log::Log;

/// What [`program`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Redirected,
    Skipped(String),
}

/// Programs sidecar redirection for `pod` (Kubernetes JSON) in the namespace at `netns`. `ips`
/// are the pod's addresses from the previous plugin (an IPv6 one adds the IPv6 rules).
pub fn program(
    conf: &PluginConf,
    netns: &str,
    pod_ref: &str,
    pod: &Value,
    ips: &[IpAddr],
    log: &mut Log,
) -> Result<Outcome, CniError> {
    let fail = |what: String| CniError::internal(format!("pod {pod_ref}: {what}"));
    // Istio's plugin reads the env-only settings from its own environment; the pod's istio-proxy
    // env wins over it. Group names resolve in the node's group database, as iptables would.
    let host = sidecar::SidecarEnv {
        fallback: &|k| std::env::var(k).ok(),
        group_id: &|name| {
            nix::unistd::Group::from_name(name)
                .ok()
                .flatten()
                .map(|g| g.gid.as_raw())
        },
    };
    let cfg = match sidecar::detect_with(pod, sidecar::has_ipv6(ips.iter().copied()), &host) {
        Ok(Detection::Skip(why)) => {
            log.info("not a sidecar pod, letting it through", &[("reason", &why)]);
            return Ok(Outcome::Skipped(why));
        }
        Ok(Detection::Sidecar(cfg)) => cfg,
        Err(e) => return Err(fail(format!("invalid sidecar configuration: {e}"))),
    };
    let name = if conf.native_nftables {
        "nftables"
    } else {
        "iptables"
    };
    // Variant detection runs here, in the plugin's own (host) namespace.
    let backend = SidecarBackend::new(name, None, cfg.ipv6)
        .map_err(|e| fail(format!("sidecar redirection backend: {e}")))?;
    let ns = Netns::open(netns).map_err(|e| fail(format!("cannot open netns {netns}: {e}")))?;
    backend
        .apply(&ns, &cfg)
        .map_err(|e| fail(format!("sidecar redirection ({name}) failed: {e}")))?;
    log.info("sidecar redirection programmed", &[("backend", name)]);
    Ok(Outcome::Redirected)
}
