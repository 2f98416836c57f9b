//! Pod annotations (anyone who can create a pod writes them) turned into rule configurations,
//! ambient (`inpod_config`) and sidecar (`detect`): any key/value set yields a config or a clear
//! error, and the rules rendered from an accepted config are well-formed, i.e. a value can never
//! smuggle extra iptables lines in.
//!
//! Input layout: first byte = flags (bit 0: IPv6), then NUL-separated key, value, key, value, …

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::iptables::inpod_restore;
use cni_core::redirect::ambient::nft::inpod_ruleset;
use cni_core::redirect::ambient::overrides::inpod_config;
use cni_core::redirect::iptables::TablesState;
use cni_core::redirect::sidecar::{self, ANNOTATION_STATUS, Detection, PROXY_CONTAINER};
use serde_json::{Map, Value, json};

/// Restore input we generate must read back as restore input, line by line.
fn well_formed(restore: &[(impl std::fmt::Debug, String)]) {
    for (family, text) in restore {
        if let Err(e) = TablesState::parse(text) {
            panic!("{family:?} rules do not parse back: {e}\n{text}");
        }
    }
}

pub fn run(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let ipv6 = flags & 1 != 0;
    let fields: Vec<&str> = rest
        .split(|b| *b == 0)
        .map(|f| std::str::from_utf8(f).unwrap_or_default())
        .collect();
    let pairs: Vec<(&str, &str)> = fields.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect();

    let global = InpodConfig {
        ipv6,
        ..InpodConfig::default()
    };
    if let Ok((cfg, _ignored)) = inpod_config(&global, pairs.iter().copied()) {
        well_formed(&inpod_restore(&cfg));
        let _ = inpod_ruleset(&cfg).render();
    }

    let mut annotations: Map<String, Value> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), Value::String((*v).to_string())))
        .collect();
    annotations
        .entry(ANNOTATION_STATUS)
        .or_insert_with(|| json!("{}"));
    let pod = json!({
        "metadata": {"name": "p", "namespace": "ns", "annotations": annotations},
        "spec": {"containers": [{"name": PROXY_CONTAINER, "args": ["proxy", "sidecar"]}]},
    });
    if let Ok(Detection::Sidecar(cfg)) = sidecar::detect(&pod, ipv6) {
        well_formed(&sidecar::iptables::restore(&cfg));
        let _ = sidecar::nft::ruleset(&cfg).render();
    }
}
