//! What the kernel answers when the agent reads nftables back (a pod's tables at every drift
//! check, the host's nat table): `NFT_MSG_NEWTABLE`, `NEWCHAIN`, `NEWSET` and `NEWRULE` replies
//! through our own framing, dump collection and decoding (`dataplane::netlink`,
//! `dataplane::nft::wire::decode_tables`): no bytes may panic them, only the tables asked for
//! come back, and what is decoded renders.
//!
//! Input layout: one datagram as received, holding the replies to all four dumps; replies count
//! when their sequence number is 1.

use cni_core::redirect::ambient::nft::INPOD_TABLES;
use dataplane::netlink::{DumpReplies, messages};
use dataplane::nft::wire::{decode_tables, reply_type};

/// The sequence number of the requests the replies answer.
const SEQ: u32 = 1;

pub fn run(data: &[u8]) {
    let Ok(ruleset) = decode_tables(&INPOD_TABLES, |_request, kind| {
        let wanted = reply_type(kind);
        let mut replies = DumpReplies::new(SEQ, |t| t == wanted);
        messages(data, |msg| replies.take(msg))?;
        replies.finish()
    }) else {
        return;
    };
    let names: Vec<&str> = ruleset.tables.iter().map(|t| t.name.as_str()).collect();
    assert!(
        names.iter().all(|t| INPOD_TABLES.contains(t)),
        "tables not asked for: {names:?}"
    );
    let _ = ruleset.render();
}
