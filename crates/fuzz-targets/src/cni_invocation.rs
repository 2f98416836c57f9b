//! What a container runtime hands the plugin: the `CNI_*` environment (including `CNI_ARGS`) and
//! the network config on stdin with its `prevResult`. Every check the plugin makes before it
//! acts must return a value or a CNI error, never panic.
//!
//! Input layout: NUL-separated `CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME`,
//! `CNI_ARGS`, `CNI_PATH`, `CNI_NETNS_OVERRIDE`, then the rest is stdin.

use std::collections::HashMap;

use cni_core::cni::env::{Invocation, check_stdin, read_env};
use cni_core::cni::result::{empty_result, prev_result_ips};
use cni_core::cni::{K8sArgs, version};
use cni_core::plugin_conf::PluginConf;

const VARS: [&str; 7] = [
    "CNI_COMMAND",
    "CNI_CONTAINERID",
    "CNI_NETNS",
    "CNI_IFNAME",
    "CNI_ARGS",
    "CNI_PATH",
    "CNI_NETNS_OVERRIDE",
];

pub fn run(data: &[u8]) {
    let mut parts = data.splitn(VARS.len() + 1, |b| *b == 0);
    let mut env: HashMap<String, String> = HashMap::new();
    for name in VARS {
        let Some(value) = parts.next() else { break };
        // The environment is bytes; std hands the plugin only valid UTF-8 (else it is unset).
        if let Ok(v) = std::str::from_utf8(value) {
            env.insert(name.to_string(), v.to_string());
        }
    }
    let stdin = parts.next().unwrap_or_default();

    let _ = K8sArgs::parse(env.get("CNI_ARGS").map_or("", String::as_str));
    let _ = version::decode(stdin);
    let conf = PluginConf::parse(stdin);
    if let Ok(conf) = &conf {
        let _ = conf.run_dir();
        let _ = conf.is_excluded("default");
        let _ = conf.is_own_agent_pod("istio-cni-node-x", "istio-system");
    }

    let Ok(Invocation::Run { command, args }) = read_env(&env) else {
        return;
    };
    let _ = args.netns_override();
    let _ = K8sArgs::parse(&args.args).map(|a| a.is_pod());
    let Ok(conf_version) = check_stdin(&command, stdin) else {
        return;
    };
    let _ = empty_result(&conf_version);
    if let Ok(conf) = conf
        && let Some(prev) = conf.prev_result
    {
        let _ = prev_result_ips(prev.get(), &conf_version);
    }
}
