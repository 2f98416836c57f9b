//! What the kernel answers when a pod's policy routing is read back (every drift check, and a
//! restarted agent for every pod): `RTM_NEWLINK`, `RTM_NEWROUTE` and `RTM_NEWRULE` replies, with
//! `NLMSG_ERROR` (and its extended ack) and `NLMSG_DONE` among them, through our own framing,
//! dump collection and decoding (`dataplane::netlink`, `dataplane::routes`): no bytes may panic
//! them, and what is found is each of the policy's pieces at most once.
//!
//! Input layout: one datagram as received; replies count when their sequence number is 1.

use dataplane::netlink::{DumpReplies, Payloads, messages};
use dataplane::routes::{Policy, RTM_NEWLINK, RTM_NEWROUTE, RTM_NEWRULE, loopback_of, present};

/// The sequence number of the request the replies answer.
const SEQ: u32 = 1;

/// The replies of type `kind` the datagram holds, as a dump collects them.
fn dump(data: &[u8], kind: u16) -> Option<Payloads> {
    let mut replies = DumpReplies::new(SEQ, |t| t == kind);
    messages(data, |msg| replies.take(msg)).ok()?;
    replies.finish().ok()
}

pub fn run(data: &[u8]) {
    if let Some(links) = dump(data, RTM_NEWLINK) {
        for (_, link) in links.iter() {
            let _ = loopback_of(link);
        }
    }
    let (Some(routes), Some(rules)) = (dump(data, RTM_NEWROUTE), dump(data, RTM_NEWRULE)) else {
        return;
    };
    let found = present(&routes, &rules, &Policy::AMBIENT);
    assert!(
        found.windows(2).all(|w| w[0] < w[1]),
        "pieces repeated or out of order: {found:?}"
    );
}
