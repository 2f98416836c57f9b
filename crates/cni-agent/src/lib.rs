//! The `install-cni` node agent: installer, ambient enrollment, ZDS server, repair and HTTP.
