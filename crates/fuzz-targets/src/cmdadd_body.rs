//! Request bodies on `pluginevent.sock` (`POST /cmdadd` from Istio's plugin, `POST /v1/cmdadd`
//! from ours): any body parses or is refused, and an accepted request survives both of our
//! encodings unchanged.

use cni_core::cmdadd::{CmdAddRequest, CmdAddResponse};

pub fn run(data: &[u8]) {
    // What the plugin reads back from the agent.
    let _ = serde_json::from_slice::<CmdAddResponse>(data);
    let Ok(req) = CmdAddRequest::from_json(data) else {
        return;
    };
    let v1 = CmdAddRequest::from_json(&req.to_v1_json()).expect("our /v1/cmdadd body parses");
    assert_eq!(v1, req);
    let istio = CmdAddRequest::from_json(&req.to_istio_json()).expect("our /cmdadd body parses");
    assert_eq!(istio.netns, req.netns);
    assert_eq!(istio.ips, req.ips);
}
