//! The `install-cni` node agent: installer, ambient enrollment, ZDS server, repair and HTTP.

#[cfg(any(test, feature = "testing"))]
pub mod testing;
