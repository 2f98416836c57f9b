//! The kubeconfig the plugin reads from the host (`<run dir>/istio-cni-kubeconfig`) and the API
//! server URL in it: any text parses or is refused, never panics.

use cni_core::kubeconfig::{parse, parse_server_url};

pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = parse_server_url(text);
    if let Ok(kc) = parse(text) {
        assert!(!kc.server.is_empty());
        if let Ok(url) = parse_server_url(&kc.server) {
            assert!(!url.host.is_empty());
            assert!(!url.base_path.ends_with('/'));
        }
    }
}
