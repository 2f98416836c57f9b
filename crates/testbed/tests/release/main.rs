//! Integration tests of the release (`scripts/release`): its SBOMs and arm64 image under
//! qemu-user, and the release pushed to a real registry and installed on a real node from it.
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time, each as it did alone.

mod arm64_release;
mod release_registry;
