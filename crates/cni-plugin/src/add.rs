//! CNI ADD: decide whether the new sandbox needs the mesh, and never let an ambient pod start
//! without its redirection.
//!
//! Order: parse the config → the agent's own pod passes (before anything that needs the agent or
//! the API server, so a rebooted node can bring its agent back) → non-Kubernetes sandboxes pass →
//! excluded namespaces pass → with ambient enabled, ask the agent (`POST /v1/cmdadd`).
//!
//! When the agent cannot answer, the plugin asks the API server itself: a pod that is not ambient
//! starts (non-mesh workloads keep running while the agent restarts), an ambient pod waits up to
//! [`agent::RESTART_WAIT`] for an agent to listen again and then fails the ADD (the runtime retries
//! the sandbox until the agent is back), and a failed lookup fails the ADD.
//! An Istio agent (404 on `/v1/cmdadd`) gets Istio's flow: API lookup, then `POST /cmdadd`.
//!
//! Sidecar pods (the agent's `sidecar` decision, or a pod read from the API server when the agent
//! cannot answer, or with ambient disabled): the plugin programs the sidecar redirection inside
//! `CNI_NETNS` itself ([`crate::sidecar`]); failure fails the ADD.

use std::net::IpAddr;
use std::thread::sleep;
use std::time::Duration;

use cni_core::cmdadd::{
    CmdAddRequest, CmdAddResponse, EVENT_SOCKET, ISTIO_CMDADD_PATH, KUBECONFIG_FILE, V1_CMDADD_PATH,
};
use cni_core::cni::result::{empty_result, prev_result_ips};
use cni_core::cni::{CmdArgs, CniError, K8sArgs};
use cni_core::enroll::{CompiledSelectors, PodView, labels_from_json};
use cni_core::plugin_conf::PluginConf;

use crate::agent::{self, AgentError};
use crate::http::Response;
use crate::kube::{ApiClient, Kubeconfig};
use crate::log::Log;
use crate::sidecar;

/// Per API request; the runtime's own CNI timeout is minutes, the pod's start is what waits.
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs ADD and returns what to print on success: the previous result untouched, or an empty
/// result of the config's version.
pub fn cmd_add(
    args: &CmdArgs,
    stdin: &[u8],
    conf_version: &str,
    log: &mut Log,
) -> Result<Vec<u8>, CniError> {
    let conf = PluginConf::parse(stdin)?;
    log.configure(&conf.plugin_log_level, conf.run_dir());
    let output = match &conf.prev_result {
        Some(raw) => raw.get().as_bytes().to_vec(),
        None => cni_core::cni::error::go_pretty(&empty_result(conf_version)),
    };
    let k8s = K8sArgs::parse(&args.args).map_err(|e| CniError::internal(e.to_string()))?;
    if !k8s.pod_name.is_empty() || !k8s.pod_namespace.is_empty() {
        log.label("pod", &format!("{}/{}", k8s.pod_namespace, k8s.pod_name));
    }
    if conf.is_own_agent_pod(&k8s.pod_name, &k8s.pod_namespace) {
        log.info("own istio-cni agent pod, letting it through", &[]);
        return Ok(output);
    }
    if !k8s.is_pod() {
        log.debug("not a kubernetes pod", &[]);
        return Ok(output);
    }
    if conf.is_excluded(&k8s.pod_namespace) {
        log.info("pod namespace excluded", &[]);
        return Ok(output);
    }
    let ips = match &conf.prev_result {
        Some(raw) => prev_result_ips(raw.get(), conf_version)?,
        None => Vec::new(),
    };
    if !conf.ambient_enabled {
        // Istio's sidecar branch: the pod itself says whether it needs redirection.
        let addrs: Vec<IpAddr> = ips.iter().map(|c| c.address.addr()).collect();
        let pod_ref = format!("{}/{}", k8s.pod_namespace, k8s.pod_name);
        let pod = get_pod_for_sidecar(&conf, &k8s.pod_namespace, &k8s.pod_name, log)?;
        sidecar::program(&conf, &args.netns, &pod_ref, &pod, &addrs, log)?;
        return Ok(output);
    }
    let req = CmdAddRequest {
        netns: args.netns.clone(),
        pod_name: k8s.pod_name.clone(),
        pod_namespace: k8s.pod_namespace.clone(),
        ips,
        pod_uid: k8s.pod_uid.clone(),
        container_id: args.container_id.clone(),
    };
    Ambient {
        conf: &conf,
        req: &req,
        log,
    }
    .run()?;
    Ok(output)
}

struct Ambient<'a> {
    conf: &'a PluginConf,
    req: &'a CmdAddRequest,
    log: &'a mut Log,
}

impl Ambient<'_> {
    fn pod(&self) -> String {
        format!("{}/{}", self.req.pod_namespace, self.req.pod_name)
    }

    fn run(&mut self) -> Result<(), CniError> {
        match self.post(Duration::ZERO) {
            Err(AgentError::Unreachable { reason, .. }) => self.agent_down(&reason),
            answer => self.answered(answer),
        }
    }

    fn post(&self, wait: Duration) -> Result<Response, AgentError> {
        let socket = self.conf.run_dir().join(EVENT_SOCKET);
        let body = self.req.to_v1_json();
        agent::post_waiting(&socket, V1_CMDADD_PATH, &body, agent::TIMEOUT, wait)
    }

    /// Acts on the agent's decision.
    fn answered(&mut self, answer: Result<Response, AgentError>) -> Result<(), CniError> {
        match answer {
            Ok(resp) if resp.status == 200 => {
                let decision: CmdAddResponse = serde_json::from_slice(&resp.body).map_err(|e| {
                    CniError::internal(format!(
                        "istio-cni agent sent an unreadable decision for pod {}: {e}: {}",
                        self.pod(),
                        resp.text()
                    ))
                })?;
                match decision {
                    // The agent logs the enrollment; an info record here would cost every
                    // ADD a second connection (to log.sock) before the plugin exits.
                    CmdAddResponse::Enrolled => {
                        self.log.debug("pod enrolled in the ambient mesh", &[])
                    }
                    CmdAddResponse::NotAmbient { reason } => {
                        self.log.debug("pod is not ambient", &[("reason", &reason)]);
                    }
                    CmdAddResponse::Sidecar { pod } => return self.sidecar(&pod),
                }
                Ok(())
            }
            Ok(resp) if resp.status == 404 => {
                self.log
                    .info("agent has no /v1/cmdadd, using Istio's /cmdadd flow", &[]);
                self.istio_flow()
            }
            Ok(resp) => Err(CniError::internal(format!(
                "istio-cni agent refused pod {} (status code {}): {}",
                self.pod(),
                resp.status,
                resp.text()
            ))),
            Err(e) => Err(CniError::internal(e.to_string())),
        }
    }

    /// The agent is down. Only the API server can tell whether this pod may start without it; an
    /// ambient pod waits a little for an agent to listen again (a restart or an upgrade), where
    /// Istio fails the ADD at once and the pod waits for the runtime's retry.
    fn agent_down(&mut self, cause: &str) -> Result<(), CniError> {
        self.log.warn(
            "istio-cni agent unreachable, asking the API server",
            &[("cause", cause)],
        );
        match self.is_ambient() {
            Ok((true, _)) => match self.post(agent::RESTART_WAIT) {
                Err(AgentError::Unreachable { reason, .. }) => Err(CniError::internal(format!(
                    "agent unreachable: refusing to start ambient pod {} unredirected: {reason}",
                    self.pod()
                ))),
                answer => {
                    self.log.info("istio-cni agent reachable again", &[]);
                    self.answered(answer)
                }
            },
            Ok((false, pod)) => {
                self.log.info("agent unreachable; pod is not ambient", &[]);
                self.sidecar(&pod)
            }
            Err(e) => Err(CniError::internal(format!(
                "agent unreachable ({cause}) and ambient membership of pod {} unknown: {e}",
                self.pod()
            ))),
        }
    }

    /// Istio's plugin flow, for an Istio agent: decide from the API server, then `/cmdadd`.
    fn istio_flow(&mut self) -> Result<(), CniError> {
        // Istio treats a failed lookup as "not ambient" and lets the pod start unredirected
        // (fail open, istio-cni.md §3.3 step 7). We fail the ADD instead; the runtime retries.
        let (ambient, pod) = self.is_ambient().map_err(|e| {
            CniError::internal(format!(
                "cannot tell whether pod {} is ambient: {e}",
                self.pod()
            ))
        })?;
        if !ambient {
            self.log.debug("pod is not ambient", &[]);
            return self.sidecar(&pod);
        }
        let socket = self.conf.run_dir().join(EVENT_SOCKET);
        let prefix = "istio-cni cmdAdd failed to contact node Istio CNI agent";
        match agent::post(
            &socket,
            ISTIO_CMDADD_PATH,
            &self.req.to_istio_json(),
            agent::TIMEOUT,
        ) {
            Ok(resp) if resp.status == 200 => {
                self.log.debug("pod enrolled in the ambient mesh", &[]);
                Ok(())
            }
            Ok(resp) => Err(CniError::internal(format!(
                "{prefix}: unable to push CNI event (status code {}): {}",
                resp.status,
                resp.text()
            ))),
            Err(e) => Err(CniError::internal(format!(
                "{prefix}: failed to send event request: {e}"
            ))),
        }
    }

    /// Programs sidecar redirection when `pod` is a sidecar pod; lets any other pod through.
    fn sidecar(&mut self, pod: &serde_json::Value) -> Result<(), CniError> {
        let addrs: Vec<IpAddr> = self.req.ips.iter().map(|c| c.address.addr()).collect();
        let pod_ref = self.pod();
        sidecar::program(self.conf, &self.req.netns, &pod_ref, pod, &addrs, self.log)?;
        Ok(())
    }

    /// Pod and namespace from the API server, through the enablement selectors. With
    /// `enable_ambient_detection_retry`, Istio's 30 retries 1 s apart; otherwise a few quick ones.
    fn is_ambient(&mut self) -> Result<(bool, serde_json::Value), String> {
        let selectors = CompiledSelectors::compile(&self.conf.enablement_selectors)
            .map_err(|e| format!("enablement_selectors: {e}"))?;
        let kc = Kubeconfig::load(&self.conf.run_dir().join(KUBECONFIG_FILE))
            .map_err(|e| e.to_string())?;
        let api = ApiClient::new(kc, API_TIMEOUT).map_err(|e| e.to_string())?;
        let (attempts, pause) = if self.conf.enable_ambient_detection_retry {
            (31, Duration::from_secs(1))
        } else {
            (3, Duration::from_millis(200))
        };
        let (ns, name) = (&self.req.pod_namespace, &self.req.pod_name);
        let mut last = String::new();
        for attempt in 1..=attempts {
            let lookup = api
                .get_pod(ns, name)
                .and_then(|pod| Ok((pod, api.get_namespace(ns)?)));
            match lookup {
                Ok((pod, namespace)) => {
                    let ambient = selectors
                        .matches(&PodView::from_pod_json(&pod), &labels_from_json(&namespace));
                    return Ok((ambient, pod));
                }
                Err(e) => {
                    last = e.to_string();
                    self.log.debug(
                        "pod lookup failed",
                        &[("attempt", &attempt.to_string()), ("error", &last)],
                    );
                }
            }
            if attempt < attempts {
                sleep(pause);
            }
        }
        Err(last)
    }
}

/// The Pod for the sidecar decision with ambient disabled: Istio's 30 attempts 1 s apart; a pod
/// that cannot be read fails the ADD (a sidecar pod must not start unredirected).
fn get_pod_for_sidecar(
    conf: &PluginConf,
    namespace: &str,
    name: &str,
    log: &mut Log,
) -> Result<serde_json::Value, CniError> {
    let fail = |e: String| {
        CniError::internal(format!(
            "cannot read pod {namespace}/{name} to decide on sidecar redirection: {e}"
        ))
    };
    let kc =
        Kubeconfig::load(&conf.run_dir().join(KUBECONFIG_FILE)).map_err(|e| fail(e.to_string()))?;
    let api = ApiClient::new(kc, API_TIMEOUT).map_err(|e| fail(e.to_string()))?;
    let attempts = 30;
    let mut last = String::new();
    for attempt in 1..=attempts {
        match api.get_pod(namespace, name) {
            Ok(pod) => return Ok(pod),
            Err(e) => {
                last = e.to_string();
                log.debug(
                    "pod lookup failed",
                    &[("attempt", &attempt.to_string()), ("error", &last)],
                );
            }
        }
        if attempt < attempts {
            sleep(Duration::from_secs(1));
        }
    }
    Err(fail(last))
}
