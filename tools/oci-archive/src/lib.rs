//! Container images without a container engine: a deterministic tar writer and the OCI image
//! layout around one layer, for the images the real-node tests import into containerd.

pub mod image;
pub mod tar;
