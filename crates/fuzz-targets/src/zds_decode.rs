//! Any datagram a peer can send must decode to a value or an error, never a panic, and every
//! accepted request must survive a re-encode within the packet limit.

use cni_core::zds::{MAX_MESSAGE_LEN, decode_ack, decode_hello, decode_request, encode_request};

pub fn run(data: &[u8]) {
    let _ = decode_hello(data);
    let _ = decode_ack(data);
    if let Ok(req) = decode_request(data) {
        assert!(data.len() <= MAX_MESSAGE_LEN);
        // prost drops unknown fields, so the re-encoding is never longer than the input.
        let again = encode_request(&req).expect("a decoded request re-encodes within the limit");
        assert_eq!(decode_request(&again).expect("round trip"), req);
    }
}
