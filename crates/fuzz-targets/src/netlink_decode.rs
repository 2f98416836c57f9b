//! Dumps read back from the kernel (`NFT_MSG_NEWRULE` and `NFT_MSG_NEWSETELEM` payloads) go
//! through our own netlink attribute decoder: no byte sequence may panic it, and a decoded rule
//! renders.

use dataplane::nft::wire::{decode_rule, decode_set_elements};

pub fn run(data: &[u8]) {
    if let Ok(Some((_table, rule))) = decode_rule(data) {
        let _ = rule.body();
    }
    let _ = decode_set_elements(data);
}
