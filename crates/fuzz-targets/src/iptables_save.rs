//! `iptables-save` output read back from a pod's namespace (verify, drift repair, cleanup):
//! whatever it prints parses or is refused, and what parses can be reconciled against our rules.

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::iptables::inpod_rules;
use cni_core::redirect::iptables::{Family, TablesState, jump_target, replace_restore_text};

pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for line in text.lines() {
        let _ = jump_target(line);
    }
    let Ok(state) = TablesState::parse(text) else {
        return;
    };
    let _ = state.istio_artifacts();
    // The transaction that replaces whatever is there with our rules: one command per line, so
    // nothing read back can split into extra commands.
    let desired = inpod_rules(&InpodConfig::default(), Family::V4);
    let replace = replace_restore_text(&state, &desired);
    for line in replace.lines() {
        assert!(
            ["* ", "-D ", "-F ", "-X ", "-N ", "-A ", "-I "]
                .iter()
                .any(|p| line.starts_with(p))
                || line == "COMMIT",
            "unexpected line {line:?} in\n{replace}"
        );
    }
}
