//! Integration tests that need neither root nor an API server: the chart against Istio's (helm),
//! the image layouts, the real node's manifests. Seconds to a minute; run them often.
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time, each as it did alone.

mod chart_conformance;
mod image_layout;
mod node_manifests;
