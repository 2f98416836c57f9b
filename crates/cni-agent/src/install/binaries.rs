//! Copies the plugin (every regular file of the source dir) into the host's CNI bin dirs.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::hostfs::{FileMode, HostDir, HostFsError};

#[derive(Debug, thiserror::Error)]
pub enum BinaryError {
    #[error("reading {path}: {source}")]
    Source {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{source}{hint}")]
    Target {
        source: HostFsError,
        hint: &'static str,
    },
}

const READ_ONLY_HINT: &str = "; the CNI bin dir is read-only on this host, set the platform-specific \
                              bin dir (Helm global.platform / cniBinDir)";

fn target_err(source: HostFsError) -> BinaryError {
    let read_only = match &source {
        HostFsError::Io { source, .. } | HostFsError::OpenDir { source, .. } => {
            source.raw_os_error() == Some(libc::EROFS)
        }
        _ => false,
    };
    BinaryError::Target {
        source,
        hint: if read_only { READ_ONLY_HINT } else { "" },
    }
}

/// Copies each regular file of `source` into every target dir (always, even when identical, so a
/// truncated or replaced binary heals). Returns the copied names.
pub fn copy_binaries(source: &Path, targets: &[PathBuf]) -> Result<Vec<String>, BinaryError> {
    let read_err = |path: &Path, e: std::io::Error| BinaryError::Source {
        path: path.to_path_buf(),
        source: e,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(source).map_err(|e| read_err(source, e))? {
        let entry = entry.map_err(|e| read_err(source, e))?;
        let path = entry.path();
        let meta = std::fs::metadata(&path).map_err(|e| read_err(&path, e))?;
        if let (true, Some(name)) = (meta.is_file(), entry.file_name().to_str()) {
            files.push((name.to_string(), meta.permissions().mode() & 0o7777));
        }
    }
    files.sort();
    for target in targets {
        let dir = HostDir::open(target).map_err(target_err)?;
        for (name, mode) in &files {
            let removed = dir.remove_stale_temps(name).map_err(target_err)?;
            if removed > 0 {
                tracing::info!(
                    "removed {removed} leftover temp file(s) of {name} in {}",
                    target.display()
                );
            }
            let path = source.join(name);
            let mut src = std::fs::File::open(&path).map_err(|e| read_err(&path, e))?;
            dir.copy_atomic(name, &mut src, FileMode::Exactly(*mode))
                .map_err(target_err)?;
            tracing::info!("copied {name} to {}", target.display());
        }
    }
    Ok(files.into_iter().map(|(n, _)| n).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_regular_file_and_overwrites() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("istio-cni"), b"plugin v1").unwrap();
        std::fs::write(src.path().join("istio-iptables"), b"helper").unwrap();
        std::fs::set_permissions(
            src.path().join("istio-cni"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::fs::create_dir(src.path().join("subdir")).unwrap();
        std::fs::write(dst.path().join("istio-cni.tmp.4242"), b"interrupted").unwrap();
        std::fs::write(dst.path().join("istio-cni"), b"old").unwrap();

        let copied = copy_binaries(src.path(), &[dst.path().to_path_buf()]).unwrap();
        assert_eq!(copied, ["istio-cni", "istio-iptables"]);
        assert_eq!(
            std::fs::read(dst.path().join("istio-cni")).unwrap(),
            b"plugin v1"
        );
        let mode = std::fs::metadata(dst.path().join("istio-cni"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755);
        let mut left: Vec<_> = std::fs::read_dir(dst.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["istio-cni", "istio-iptables"]);

        std::fs::write(src.path().join("istio-cni"), b"plugin v2").unwrap();
        copy_binaries(src.path(), &[dst.path().to_path_buf()]).unwrap();
        assert_eq!(
            std::fs::read(dst.path().join("istio-cni")).unwrap(),
            b"plugin v2"
        );
    }

    #[test]
    fn missing_target_dir_is_an_error() {
        let src = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("istio-cni"), b"x").unwrap();
        let err = copy_binaries(src.path(), &[src.path().join("nope")]).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }
}
