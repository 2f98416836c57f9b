//! The CNI contract as a plugin sees it (CNI spec 0.1.0–1.1.0, as libcni's `skel` v1.3.0 enforces
//! it): environment variables, the versions we accept, the error object printed on failure,
//! `CNI_ARGS`, and the network configuration's standard fields.
//!
//! Everything here is pure so the plugin binary only adds the process plumbing (read env and
//! stdin, print, exit) and every rule is tested without spawning anything.

pub mod args;
pub mod conf;
pub mod env;
pub mod error;
pub mod result;
pub mod version;

pub use args::K8sArgs;
pub use conf::NetConf;
pub use env::{CmdArgs, Command, EnvSource, Invocation};
pub use error::CniError;

/// Go's JSON decoder leaves a field at its zero value when the document has `null` there; serde
/// would reject it. Configs written by Go tools rely on that (`"exclude_namespaces": null`).
pub(crate) fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de> + Default,
{
    use serde::Deserialize as _;
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}
