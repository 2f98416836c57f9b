//! The pinned Istio module (`tools/istio/go.mod`) for conformance tests, and the one allowlist of
//! accepted differences (`tools/istio/conformance-allowlist.yaml`).
//!
//! Istio's test vectors are read from the Go module cache at test time, never copied into this
//! repository. The directory comes from `ISTIO_MODULE_DIR` when set, else from
//! `tools/istio/moddir.sh` (which downloads the module on first use). When neither yields the
//! module the test fails with what to do: a conformance test that cannot see Istio proves nothing,
//! so it must never pass quietly.

#![allow(
    dead_code,
    reason = "each conformance test binary uses its own part of this shared module"
)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root: the ancestor of this crate holding `tools/istio/moddir.sh`.
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|d| d.join("tools/istio/moddir.sh").is_file())
        .unwrap_or_else(|| {
            panic!(
                "no tools/istio/moddir.sh above {}: cannot find the repository root",
                manifest.display()
            )
        })
        .to_path_buf()
}

/// The `istio.io/istio` version pinned in `tools/istio/go.mod`.
pub fn pinned_version() -> String {
    let go_mod = repo_root().join("tools/istio/go.mod");
    let text =
        std::fs::read_to_string(&go_mod).unwrap_or_else(|e| panic!("{}: {e}", go_mod.display()));
    text.lines()
        .find_map(|l| l.trim().strip_prefix("require istio.io/istio "))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| {
            panic!(
                "{}: no `require istio.io/istio <version>`",
                go_mod.display()
            )
        })
}

/// The pinned Istio module's directory. Panics (failing the test) with a clear message when it
/// cannot be found.
pub fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(locate)
}

fn locate() -> PathBuf {
    let version = pinned_version();
    let dir = match std::env::var_os("ISTIO_MODULE_DIR").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => {
            let script = repo_root().join("tools/istio/moddir.sh");
            let out = Command::new(&script).output().unwrap_or_else(|e| {
                panic!(
                    "cannot run {}: {e}\nInstall Go, or set ISTIO_MODULE_DIR to the directory of \
                     istio.io/istio@{version}",
                    script.display()
                )
            });
            if !out.status.success() {
                panic!(
                    "{} failed ({}): {}\nInstall Go and allow it to download istio.io/istio@{version}, \
                     or set ISTIO_MODULE_DIR to that module's directory",
                    script.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    };
    // A directory named after a different version is another Istio than the one we pin.
    if let Some(name) = dir.file_name().and_then(|n| n.to_str())
        && name.starts_with("istio@")
        && name != format!("istio@{version}")
    {
        panic!(
            "{} is not the pinned istio.io/istio@{version} (tools/istio/go.mod)",
            dir.display()
        );
    }
    if !dir.join("go.mod").is_file() {
        panic!(
            "{} is not the istio.io/istio module (no go.mod); set ISTIO_MODULE_DIR to the \
             directory of istio.io/istio@{version}",
            dir.display()
        );
    }
    dir
}

/// A file of the module, by its path inside the module.
pub fn read(rel: &str) -> String {
    let path = dir().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The names of the files directly in the module's directory `rel` (sorted); a missing
/// directory fails the test, as a moved test-data directory must be noticed.
pub fn files(rel: &str) -> Vec<String> {
    let path = dir().join(rel);
    let mut names: Vec<String> = std::fs::read_dir(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .map(|e| e.expect("directory entry"))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// One accepted difference from Istio, or a vector that does not apply to us.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allowed {
    pub case: String,
    /// [`NOT_APPLICABLE`], or what differs (each conformance test says how it spells it).
    pub difference: String,
    pub why: String,
}

/// `difference` of an entry whose Istio vector cannot arise for us at all.
pub const NOT_APPLICABLE: &str = "not applicable";

/// The entries under `key` in `tools/istio/conformance-allowlist.yaml` (none when the key is
/// absent). Entries with an empty `why`, or two entries for one case, fail the test.
pub fn allowlist(key: &str) -> Vec<Allowed> {
    let path = repo_root().join("tools/istio/conformance-allowlist.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse_allowlist(&text, key).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// [`allowlist`] of a file's text: only `key` is read (the other keys belong to other tests); a
/// misspelt field is an error, never a silently ignored entry.
pub fn parse_allowlist(text: &str, key: &str) -> Result<Vec<Allowed>, String> {
    let doc: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
    let Some(section) = doc.get(key).filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let entries: Vec<Allowed> =
        serde_yaml::from_value(section.clone()).map_err(|e| format!("`{key}`: {e}"))?;
    for (i, e) in entries.iter().enumerate() {
        if e.why.trim().is_empty() || e.difference.trim().is_empty() {
            return Err(format!(
                "`{key}`: {:?} needs a difference and a why",
                e.case
            ));
        }
        if entries[..i]
            .iter()
            .any(|o| o.case == e.case && o.difference == e.difference)
        {
            return Err(format!("`{key}`: {:?} is listed twice", e.case));
        }
    }
    Ok(entries)
}

/// Which side of a comparison has a line the other lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnlyIn {
    Istio,
    Ours,
}

/// The lines only one side has, in order, from a longest-common-subsequence walk (where both
/// orders fit, ours first): a line both sides have in a different order shows as one of each.
pub fn line_diff<'a>(istio: &'a [String], ours: &'a [String]) -> Vec<(OnlyIn, &'a str)> {
    let (n, m) = (istio.len(), ours.len());
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if istio[i] == ours[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < n || j < m {
        if i < n && j < m && istio[i] == ours[j] {
            i += 1;
            j += 1;
        } else if j < m && (i == n || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out.push((OnlyIn::Ours, ours[j].as_str()));
            j += 1;
        } else {
            out.push((OnlyIn::Istio, istio[i].as_str()));
            i += 1;
        }
    }
    out
}
