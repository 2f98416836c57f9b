//! Which CNI network configs the container runtime would load from the conf dir, in priority
//! order, following libcni: `.conf` and `.conflist` files sorted by name, invalid ones skipped.
//! Unlike libcni we never follow a symlink in the conf dir (see [`crate::hostfs`]); such an entry
//! is skipped with a warning like any other unusable file.

use cni_core::conflist::{self, ConfError};

use crate::hostfs::{EntryKind, HostDir, HostFsError};

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("no networks found in {0}")]
    NoNetworks(String),
    #[error("no valid networks found in {0}")]
    NoValidNetworks(String),
    #[error(transparent)]
    HostFs(#[from] HostFsError),
}

/// Why one file was skipped.
#[derive(Debug, thiserror::Error)]
pub enum InvalidConf {
    #[error(transparent)]
    Conf(#[from] ConfError),
    #[error(transparent)]
    HostFs(#[from] HostFsError),
    #[error("plugin file {file}: {source}")]
    PluginFile { file: String, source: ConfError },
}

/// Whether a file name is one the runtime considers.
pub fn is_conf_name(name: &str) -> bool {
    name.ends_with(".conf") || name.ends_with(".conflist")
}

/// Valid config names in priority order (the first is what the runtime uses). A missing
/// directory is the same as an empty one.
pub fn config_filenames(dir: Option<&HostDir>) -> Result<Vec<String>, DiscoveryError> {
    let shown =
        |d: Option<&HostDir>| d.map_or_else(String::new, |d| d.path().display().to_string());
    let Some(d) = dir else {
        return Err(DiscoveryError::NoNetworks(shown(dir)));
    };
    let mut names: Vec<(String, EntryKind)> = d
        .list()?
        .into_iter()
        .filter(|(n, k)| is_conf_name(n) && *k != EntryKind::Dir)
        .collect();
    if names.is_empty() {
        return Err(DiscoveryError::NoNetworks(shown(dir)));
    }
    names.sort_by(|a, b| a.0.cmp(&b.0));
    let mut valid = Vec::with_capacity(names.len());
    for (name, _) in names {
        match validate(d, &name) {
            Ok(()) => valid.push(name),
            Err(e) => tracing::warn!(
                "skipping invalid CNI config {}: {e}",
                d.join(&name).display()
            ),
        }
    }
    if valid.is_empty() {
        return Err(DiscoveryError::NoValidNetworks(shown(dir)));
    }
    Ok(valid)
}

/// libcni's load of one file, including plugins from `<dir>/<name>/*.conf` for a list.
pub fn validate(dir: &HostDir, name: &str) -> Result<(), InvalidConf> {
    let Some(bytes) = dir.read(name)? else {
        return Err(HostFsError::Io {
            op: "read",
            path: dir.join(name),
            source: std::io::ErrorKind::NotFound.into(),
        }
        .into());
    };
    if name.ends_with(".conf") {
        return Ok(conflist::parse_single(&bytes)?);
    }
    let list = conflist::parse_list(&bytes)?;
    let mut total = list.inline_plugins;
    if !list.load_only_inlined {
        total += plugin_files(dir, &list.name)?;
    }
    if total == 0 {
        return Err(ConfError::NoPlugins.into());
    }
    Ok(())
}

/// Counts the valid plugin files in `<dir>/<list name>/`; an invalid one invalidates the list.
fn plugin_files(dir: &HostDir, list_name: &str) -> Result<usize, InvalidConf> {
    if !crate::hostfs::is_plain_name(list_name.as_ref())
        || dir.lstat(list_name).ok().flatten().map(|(k, _)| k) != Some(EntryKind::Dir)
    {
        return Ok(0);
    }
    let sub = HostDir::open(dir.join(list_name))?;
    let mut files: Vec<String> = sub
        .list()?
        .into_iter()
        .filter(|(n, k)| n.ends_with(".conf") && *k == EntryKind::File)
        .map(|(n, _)| n)
        .collect();
    files.sort();
    for file in &files {
        let bytes = sub.read(file)?.unwrap_or_default();
        conflist::parse_single(&bytes).map_err(|source| InvalidConf::PluginFile {
            file: format!("{list_name}/{file}"),
            source,
        })?;
    }
    Ok(files.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[(&str, &str)]) -> (tempfile::TempDir, HostDir) {
        let tmp = tempfile::tempdir().unwrap();
        for (name, content) in files {
            if let Some(parent) = std::path::Path::new(name).parent() {
                std::fs::create_dir_all(tmp.path().join(parent)).unwrap();
            }
            std::fs::write(tmp.path().join(name), content).unwrap();
        }
        let d = HostDir::open(tmp.path()).unwrap();
        (tmp, d)
    }

    const REGULAR: &str = r#"{"cniVersion":"0.3.1","name":"n","type":"bridge"}"#;

    #[test]
    fn istio_get_config_filenames_cases() {
        assert!(matches!(
            config_filenames(None),
            Err(DiscoveryError::NoNetworks(_))
        ));
        let (_t, d) = dir_with(&[]);
        assert!(matches!(
            config_filenames(Some(&d)),
            Err(DiscoveryError::NoNetworks(_))
        ));
        let (_t, d) = dir_with(&[("undetectable.file", REGULAR)]);
        assert!(matches!(
            config_filenames(Some(&d)),
            Err(DiscoveryError::NoNetworks(_))
        ));
        let (_t, d) = dir_with(&[("empty.conf", "")]);
        assert!(matches!(
            config_filenames(Some(&d)),
            Err(DiscoveryError::NoValidNetworks(_))
        ));
        let (_t, d) = dir_with(&[("regular.conf", REGULAR)]);
        assert_eq!(config_filenames(Some(&d)).unwrap(), ["regular.conf"]);
        let (_t, d) = dir_with(&[("regular2.conf", REGULAR), ("regular.conf", REGULAR)]);
        assert_eq!(
            config_filenames(Some(&d)).unwrap(),
            ["regular.conf", "regular2.conf"]
        );
    }

    #[test]
    fn invalid_files_are_skipped_in_order() {
        let (_t, d) = dir_with(&[
            ("00-bad.conf", r#"{"name":"no-type"}"#),
            ("01-noname.conflist", r#"{"plugins":[{"type":"calico"}]}"#),
            (
                "02-typo.conflist",
                r#"{"name":"k8s","pugins":[{"type":"calico"}]}"#,
            ),
            ("03-nonjson.conflist", "calico"),
            (
                "10-calico.conflist",
                r#"{"name":"k8s","plugins":[{"type":"calico"}]}"#,
            ),
            ("20-bridge.conf", REGULAR),
        ]);
        assert_eq!(
            config_filenames(Some(&d)).unwrap(),
            ["10-calico.conflist", "20-bridge.conf"]
        );
    }

    #[test]
    fn plugin_files_of_a_list_count_and_must_be_valid() {
        let (_t, d) = dir_with(&[
            (
                "10-split.conflist",
                r#"{"name":"split","cniVersion":"0.4.0"}"#,
            ),
            ("split/a.conf", r#"{"type":"bridge"}"#),
        ]);
        assert_eq!(config_filenames(Some(&d)).unwrap(), ["10-split.conflist"]);
        let (_t, d) = dir_with(&[
            ("10-split.conflist", r#"{"name":"split"}"#),
            ("split/a.conf", r#"{"name":"x"}"#),
        ]);
        let err = validate(&d, "10-split.conflist").unwrap_err();
        assert!(err.to_string().contains("split/a.conf"), "{err}");
        let (_t, d) = dir_with(&[
            (
                "10-split.conflist",
                r#"{"name":"split","loadOnlyInlinedPlugins":true,"plugins":[{"type":"a"}]}"#,
            ),
            ("split/a.conf", r#"{"name":"ignored, not loaded"}"#),
        ]);
        validate(&d, "10-split.conflist").unwrap();
    }
}
