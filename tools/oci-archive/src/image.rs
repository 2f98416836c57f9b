//! One-layer OCI images written as an OCI image layout in a tar archive, the form
//! `ctr images import` reads. The layer is uncompressed (nothing to gain on a local import, and
//! no compressor whose output could change between versions); `index.json` names the image in
//! both annotations containerd looks at, so the import tags it with the full reference. An image
//! may have several references (one index entry each, all for the same manifest), as a registry
//! image has several tags: Istio's charts name theirs `<tag>-<variant>`.
//!
//! A release is one image per platform under one name: [`index_archive`] puts single-image
//! archives (each built for its own architecture) behind an OCI image index, the form a registry
//! serves for `docker pull` on any platform.

use std::collections::BTreeMap;

use ring::digest::{SHA256, digest};
use serde_json::{Value, json};

use crate::tar::{self, Tree};

const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX_TYPE: &str = "application/vnd.oci.image.index.v1+json";
const CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";
/// containerd's own annotation; it takes precedence over the OCI one on import.
pub const CONTAINERD_NAME: &str = "io.containerd.image.name";
pub const OCI_REF_NAME: &str = "org.opencontainers.image.ref.name";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageError {
    #[error(
        "image reference {0:?} must be <name>:<tag>, lower-case name components of [a-z0-9._-] \
         separated by `/`, tag of [A-Za-z0-9._-]"
    )]
    BadReference(String),
    #[error("environment entry {0:?} must be NAME=VALUE")]
    BadEnv(String),
    #[error("architecture {0:?} is not an OCI architecture name (amd64, arm64, …)")]
    BadArchitecture(String),
    #[error("image archive #{index}: {problem}")]
    BadArchive { index: usize, problem: String },
    #[error("two images for linux/{0}: an index has one image per platform")]
    DuplicatePlatform(String),
}

/// What goes into the image config besides the layer.
#[derive(Debug, Default, Clone)]
pub struct Config {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub workdir: Option<String>,
    /// `User` of the image config (`uid[:gid]`): a pod with `runAsNonRoot` and no `runAsUser`
    /// starts only when the image names a numeric non-root user.
    pub user: Option<String>,
    /// `Labels` of the image config (`org.opencontainers.image.source`, …).
    pub labels: BTreeMap<String, String>,
    /// The OCI architecture the binaries are built for; the machine's own when `None`.
    pub architecture: Option<String>,
}

/// `amd64`/`arm64`/… for the machine this runs on, as OCI spells it.
pub fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

pub fn check_reference(reference: &str) -> Result<(), ImageError> {
    let bad = || ImageError::BadReference(reference.into());
    let (name, tag) = reference.rsplit_once(':').ok_or_else(bad)?;
    let component = |c: &str| {
        !c.is_empty()
            && c.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
    };
    // The first of several components may be a registry with a port (`127.0.0.1:5000/x`).
    let mut parts = name.split('/');
    let first = parts.next().unwrap_or_default();
    let first_ok = match first.split_once(':') {
        Some((host, port)) if name.contains('/') => {
            component(host) && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
        }
        Some(_) => false,
        None => component(first),
    };
    let name_ok = first_ok && parts.all(component);
    let tag_ok = !tag.is_empty()
        && tag.len() <= 128
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if name_ok && tag_ok {
        Ok(())
    } else {
        Err(bad())
    }
}

fn check_architecture(arch: &str) -> Result<(), ImageError> {
    let ok = !arch.is_empty()
        && arch
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(ImageError::BadArchitecture(arch.into()))
    }
}

fn sha256(data: &[u8]) -> String {
    let d = digest(&SHA256, data);
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn descriptor(media_type: &str, blob: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": sha256(blob), "size": blob.len()})
}

fn blob_path(blob: &[u8]) -> String {
    format!("/{}", blob_key(&sha256(blob)))
}

/// Where the blob of `digest` is in a layout archive (as [`tar::read_files`] names it).
fn blob_key(digest: &str) -> String {
    format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"))
}

/// The image as an OCI layout archive, and the manifest's digest.
pub fn archive(
    reference: &str,
    rootfs: &Tree,
    config: &Config,
) -> Result<(Vec<u8>, String), ImageError> {
    archive_named(&[reference], rootfs, config)
}

/// [`archive`] with every name in `references` (at least one), each an index entry of the same
/// manifest.
pub fn archive_named(
    references: &[&str],
    rootfs: &Tree,
    config: &Config,
) -> Result<(Vec<u8>, String), ImageError> {
    if references.is_empty() {
        return Err(ImageError::BadReference(String::new()));
    }
    for reference in references {
        check_reference(reference)?;
    }
    if let Some(bad) = config
        .env
        .iter()
        .find(|e| e.split_once('=').is_none_or(|(k, _)| k.is_empty()))
    {
        return Err(ImageError::BadEnv(bad.clone()));
    }
    let arch = config.architecture.as_deref().unwrap_or(host_arch());
    check_architecture(arch)?;
    let layer = rootfs.to_tar();
    let mut runtime = serde_json::Map::new();
    if !config.env.is_empty() {
        runtime.insert("Env".into(), json!(config.env));
    }
    if !config.entrypoint.is_empty() {
        runtime.insert("Entrypoint".into(), json!(config.entrypoint));
    }
    if !config.cmd.is_empty() {
        runtime.insert("Cmd".into(), json!(config.cmd));
    }
    if let Some(dir) = &config.workdir {
        runtime.insert("WorkingDir".into(), json!(dir));
    }
    if let Some(user) = &config.user {
        runtime.insert("User".into(), json!(user));
    }
    if !config.labels.is_empty() {
        runtime.insert("Labels".into(), json!(config.labels));
    }
    let image_config = to_bytes(&json!({
        "architecture": arch,
        "os": "linux",
        "config": runtime,
        "rootfs": {"type": "layers", "diff_ids": [sha256(&layer)]},
    }));
    let manifest = to_bytes(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": descriptor(CONFIG_TYPE, &image_config),
        "layers": [descriptor(LAYER_TYPE, &layer)],
    }));
    let platform = json!({"architecture": arch, "os": "linux"});
    let index = top_index(references, MANIFEST_TYPE, &manifest, Some(&platform), |r| r);
    Ok((
        layout(&index, [&layer, &image_config, &manifest]),
        sha256(&manifest),
    ))
}

/// `index.json`: one entry per name, all for `target`. `ref_name` gives what the OCI annotation
/// holds; containerd's always holds the whole reference.
fn top_index(
    references: &[&str],
    media_type: &str,
    target: &[u8],
    platform: Option<&Value>,
    ref_name: impl Fn(&str) -> &str,
) -> Vec<u8> {
    let entries: Vec<Value> = references
        .iter()
        .map(|reference| {
            let mut entry = descriptor(media_type, target);
            if let Some(p) = platform {
                entry["platform"] = p.clone();
            }
            entry["annotations"] =
                json!({CONTAINERD_NAME: reference, OCI_REF_NAME: ref_name(reference)});
            entry
        })
        .collect();
    to_bytes(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX_TYPE,
        "manifests": entries,
    }))
}

/// The OCI layout as a tar: `oci-layout`, `index.json` and every blob under its digest.
fn layout<'a>(index: &[u8], blobs: impl IntoIterator<Item = &'a Vec<u8>>) -> Vec<u8> {
    let mut out = Tree::new();
    let file = |t: &mut Tree, path: &str, data: &[u8]| {
        // Distinct blobs never share a path; an equal blob twice (two platforms' identical
        // layers) is stored once.
        match t.file(path, 0o644, data.to_vec()) {
            Ok(()) | Err(tar::TreeError::Duplicate(_)) => {}
            Err(e) => panic!("layout paths are fixed: {e}"),
        }
    };
    file(
        &mut out,
        "/oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    );
    file(&mut out, "/index.json", index);
    for blob in blobs {
        file(&mut out, &blob_path(blob), blob);
    }
    out.to_tar()
}

/// An OCI image index over single-image archives (each as [`archive_named`] writes them, one
/// platform each), named by every one of `references`, with `annotations` on the index; and the
/// index's digest, the one a registry serves for all the names. The OCI name annotation holds the
/// tag, as the OCI layout has it (what `skopeo` and `oras` select by), containerd's the whole
/// reference.
pub fn index_archive(
    references: &[&str],
    archives: &[Vec<u8>],
    annotations: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, String), ImageError> {
    if references.is_empty() {
        return Err(ImageError::BadReference(String::new()));
    }
    for reference in references {
        check_reference(reference)?;
    }
    let mut blobs: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut manifests: BTreeMap<String, Value> = BTreeMap::new();
    for (index, archive) in archives.iter().enumerate() {
        let bad = |problem: String| ImageError::BadArchive { index, problem };
        let mut files = tar::read_files(archive).map_err(|e| bad(e.to_string()))?;
        let top: Value = files
            .get("index.json")
            .and_then(|b| serde_json::from_slice(b).ok())
            .ok_or_else(|| bad("no index.json, or not JSON".into()))?;
        let entries = top["manifests"].as_array().cloned().unwrap_or_default();
        if entries.is_empty() {
            return Err(bad("index.json names no image".into()));
        }
        for entry in entries {
            let (Some(digest), Some(arch)) = (
                entry["digest"].as_str(),
                entry["platform"]["architecture"].as_str(),
            ) else {
                return Err(bad(format!("entry {entry} has no digest or platform")));
            };
            if entry["mediaType"] != MANIFEST_TYPE {
                return Err(bad(format!("{digest} is not an image manifest")));
            }
            match manifests.get(arch) {
                Some(seen) if seen["digest"] == digest => continue,
                Some(_) => return Err(ImageError::DuplicatePlatform(arch.into())),
                None => {}
            }
            let manifest_bytes = files
                .get(&blob_key(digest))
                .filter(|b| sha256(b) == digest)
                .ok_or_else(|| bad(format!("manifest {digest} is missing or does not match")))?
                .clone();
            let manifest_bytes = &manifest_bytes;
            let manifest: Value = serde_json::from_slice(manifest_bytes)
                .map_err(|e| bad(format!("manifest {digest}: {e}")))?;
            let layers = manifest["layers"].as_array().cloned().unwrap_or_default();
            for d in std::iter::once(&manifest["config"]).chain(&layers) {
                let want = d["digest"].as_str().unwrap_or_default();
                let blob = files
                    .remove(&blob_key(want))
                    .filter(|b| sha256(b) == want)
                    .ok_or_else(|| bad(format!("blob {want} is missing or does not match")))?;
                blobs.insert(want.into(), blob);
            }
            blobs.insert(digest.into(), manifest_bytes.clone());
            let mut descriptor = descriptor(MANIFEST_TYPE, manifest_bytes);
            descriptor["platform"] = json!({"architecture": arch, "os": "linux"});
            manifests.insert(arch.into(), descriptor);
        }
    }
    if manifests.is_empty() {
        return Err(ImageError::BadArchive {
            index: 0,
            problem: "no image archives given".into(),
        });
    }
    let mut image_index = json!({
        "schemaVersion": 2,
        "mediaType": INDEX_TYPE,
        "manifests": manifests.into_values().collect::<Vec<_>>(),
    });
    if !annotations.is_empty() {
        image_index["annotations"] = json!(annotations);
    }
    let image_index = to_bytes(&image_index);
    let top = top_index(references, INDEX_TYPE, &image_index, None, |r| {
        r.rsplit_once(':').map_or(r, |(_, tag)| tag)
    });
    let all = blobs.values().chain(std::iter::once(&image_index));
    Ok((layout(&top, all), sha256(&image_index)))
}
fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("JSON values always serialise")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(archive: &[u8]) -> BTreeMap<String, Vec<u8>> {
        tar::read_files(archive).unwrap()
    }

    fn busybox_tree() -> Tree {
        let mut t = Tree::new();
        t.file("/bin/busybox", 0o755, b"\x7fELF".to_vec()).unwrap();
        t.symlink("/bin/sh", "busybox").unwrap();
        t
    }

    #[test]
    fn layout_links_index_manifest_config_and_layer_by_digest() {
        let cfg = Config {
            entrypoint: vec!["/bin/sh".into()],
            env: vec!["PATH=/bin".into()],
            ..Config::default()
        };
        let (tar, manifest_digest) =
            archive("localhost/x/busybox:dev", &busybox_tree(), &cfg).unwrap();
        let files = read(&tar);
        assert_eq!(files["oci-layout"], br#"{"imageLayoutVersion":"1.0.0"}"#);
        let index: Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let m = &index["manifests"][0];
        assert_eq!(m["digest"], manifest_digest.as_str());
        assert_eq!(m["annotations"][CONTAINERD_NAME], "localhost/x/busybox:dev");
        assert_eq!(m["annotations"][OCI_REF_NAME], "localhost/x/busybox:dev");
        assert_eq!(m["platform"]["os"], "linux");
        let blob = |d: &Value| &files[&format!("blobs/sha256/{}", &d.as_str().unwrap()[7..])];
        let manifest_bytes = blob(&m["digest"]);
        assert_eq!(m["size"], manifest_bytes.len());
        assert_eq!(sha256(manifest_bytes), manifest_digest);
        let manifest: Value = serde_json::from_slice(manifest_bytes).unwrap();
        let config: Value = serde_json::from_slice(blob(&manifest["config"]["digest"])).unwrap();
        assert_eq!(config["config"]["Entrypoint"], json!(["/bin/sh"]));
        assert_eq!(config["config"]["Env"], json!(["PATH=/bin"]));
        assert_eq!(config["architecture"], host_arch());
        let layer = blob(&manifest["layers"][0]["digest"]);
        assert_eq!(manifest["layers"][0]["mediaType"], LAYER_TYPE);
        // Uncompressed layer: its diff id is its own digest, and it is the tree's tar.
        assert_eq!(config["rootfs"]["diff_ids"][0], sha256(layer));
        assert_eq!(*layer, busybox_tree().to_tar());
    }

    #[test]
    fn same_inputs_give_the_same_archive() {
        let cfg = Config::default();
        let a = archive("localhost/x/y:dev", &busybox_tree(), &cfg).unwrap();
        let b = archive("localhost/x/y:dev", &busybox_tree(), &cfg).unwrap();
        assert_eq!(a, b);
        let other = archive("localhost/x/y:other", &busybox_tree(), &cfg).unwrap();
        assert_eq!(
            a.1, other.1,
            "the ref is in index.json only, not in the manifest"
        );
        assert_ne!(a.0, other.0);
    }

    #[test]
    fn several_names_for_one_manifest_and_a_user() {
        let cfg = Config {
            user: Some("1337:1337".into()),
            ..Config::default()
        };
        let refs = ["localhost/x/pilot:dev", "localhost/x/pilot:dev-distroless"];
        let (tar, digest) = archive_named(&refs, &busybox_tree(), &cfg).unwrap();
        let files = read(&tar);
        let index: Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let entries = index["manifests"].as_array().unwrap();
        assert_eq!(entries.len(), 2);
        for (entry, reference) in entries.iter().zip(refs) {
            assert_eq!(entry["digest"], digest.as_str());
            assert_eq!(entry["annotations"][CONTAINERD_NAME], reference);
        }
        let manifest: Value =
            serde_json::from_slice(&files[&format!("blobs/sha256/{}", &digest[7..])]).unwrap();
        let config_digest = manifest["config"]["digest"].as_str().unwrap();
        let config: Value =
            serde_json::from_slice(&files[&format!("blobs/sha256/{}", &config_digest[7..])])
                .unwrap();
        assert_eq!(config["config"]["User"], "1337:1337");
        // One name or two: the same image.
        assert_eq!(archive(refs[0], &busybox_tree(), &cfg).unwrap().1, digest);
        assert!(archive_named(&[], &busybox_tree(), &cfg).is_err());
        assert!(archive_named(&[refs[0], "Bad:ref"], &busybox_tree(), &cfg).is_err());
    }

    fn for_arch(arch: &str, content: &[u8]) -> Vec<u8> {
        let mut t = Tree::new();
        t.file("/bin/agent", 0o755, content.to_vec()).unwrap();
        let cfg = Config {
            architecture: Some(arch.into()),
            labels: [("org.opencontainers.image.version".into(), "1.2.3".into())].into(),
            ..Config::default()
        };
        archive_named(&["x/agent:1.2.3", "x/agent:alias"], &t, &cfg)
            .unwrap()
            .0
    }

    #[test]
    fn an_index_names_one_manifest_per_platform_with_all_their_blobs() {
        let inputs = [for_arch("amd64", b"x86"), for_arch("arm64", b"aarch64")];
        let annotations: BTreeMap<String, String> =
            [("org.opencontainers.image.revision".into(), "abc".into())].into();
        let refs = [
            "127.0.0.1:5000/x/agent:1.2.3",
            "127.0.0.1:5000/x/agent:1.2.3-distroless",
        ];
        let (tar, digest) = index_archive(&refs, &inputs, &annotations).unwrap();
        let files = tar::read_files(&tar).unwrap();
        let top: Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let entries = top["manifests"].as_array().unwrap();
        assert_eq!(entries.len(), 2);
        for (entry, reference) in entries.iter().zip(refs) {
            assert_eq!(entry["mediaType"], INDEX_TYPE);
            assert_eq!(entry["digest"], digest.as_str());
            assert_eq!(entry["annotations"][CONTAINERD_NAME], reference);
            // The OCI layout's own convention: the tag alone.
            assert_eq!(
                entry["annotations"][OCI_REF_NAME],
                reference.rsplit_once(':').unwrap().1
            );
        }
        let blob = |d: &Value| files[&blob_key(d.as_str().unwrap())].clone();
        let index_bytes = blob(&entries[0]["digest"]);
        assert_eq!(sha256(&index_bytes), digest);
        let index: Value = serde_json::from_slice(&index_bytes).unwrap();
        assert_eq!(
            index["annotations"]["org.opencontainers.image.revision"],
            "abc"
        );
        let mut seen = Vec::new();
        for m in index["manifests"].as_array().unwrap() {
            let arch = m["platform"]["architecture"].as_str().unwrap().to_string();
            let manifest: Value = serde_json::from_slice(&blob(&m["digest"])).unwrap();
            let config: Value =
                serde_json::from_slice(&blob(&manifest["config"]["digest"])).unwrap();
            assert_eq!(config["architecture"], arch.as_str());
            assert_eq!(
                config["config"]["Labels"]["org.opencontainers.image.version"],
                "1.2.3"
            );
            let layer = tar::read_files(&blob(&manifest["layers"][0]["digest"])).unwrap();
            seen.push((arch, layer["bin/agent"].clone()));
        }
        assert_eq!(
            seen,
            [
                ("amd64".into(), b"x86".to_vec()),
                ("arm64".into(), b"aarch64".to_vec())
            ]
        );
        // Input order does not matter; the same inputs give the same bytes.
        let swapped = [inputs[1].clone(), inputs[0].clone()];
        assert_eq!(
            index_archive(&refs, &swapped, &annotations).unwrap(),
            (tar, digest)
        );
    }

    #[test]
    fn an_index_refuses_two_images_for_one_platform_and_broken_archives() {
        let refs = ["x/agent:1"];
        let none = BTreeMap::new();
        assert_eq!(
            index_archive(
                &refs,
                &[for_arch("arm64", b"a"), for_arch("arm64", b"b")],
                &none
            ),
            Err(ImageError::DuplicatePlatform("arm64".into()))
        );
        let mut t = Tree::new();
        t.file("/index.json", 0o644, b"{}".to_vec()).unwrap();
        assert!(matches!(
            index_archive(&refs, &[for_arch("amd64", b"a"), t.to_tar()], &none),
            Err(ImageError::BadArchive { index: 1, .. })
        ));
        // A layer that is not what the manifest says.
        let mut files = tar::read_files(&for_arch("amd64", b"a")).unwrap();
        let mut broken = Tree::new();
        for (path, mut data) in std::mem::take(&mut files) {
            if data.len() > 1024 {
                data[600] ^= 1;
            }
            broken.file(&format!("/{path}"), 0o644, data).unwrap();
        }
        let err = index_archive(&refs, &[broken.to_tar()], &none).unwrap_err();
        assert!(err.to_string().contains("does not match"), "{err}");
        assert_eq!(
            index_archive(&refs, &[], &none),
            Err(ImageError::BadArchive {
                index: 0,
                problem: "no image archives given".into()
            })
        );
        let cfg = Config {
            architecture: Some("ARM".into()),
            ..Config::default()
        };
        assert_eq!(
            archive("x:1", &Tree::new(), &cfg).unwrap_err(),
            ImageError::BadArchitecture("ARM".into())
        );
    }

    #[test]
    fn bad_references_and_env_are_refused() {
        for bad in [
            "",
            "busybox",
            "Localhost/x:dev",
            "x/:dev",
            "x:",
            "x:a/b",
            "x y:dev",
            "127.0.0.1:5000:dev",
            "127.0.0.1:/x:dev",
            "127.0.0.1:50a/x:dev",
        ] {
            assert_eq!(
                archive(bad, &Tree::new(), &Config::default()).unwrap_err(),
                ImageError::BadReference(bad.into())
            );
        }
        let cfg = Config {
            env: vec!["NOVALUE".into()],
            ..Config::default()
        };
        assert_eq!(
            archive("x:dev", &Tree::new(), &cfg).unwrap_err(),
            ImageError::BadEnv("NOVALUE".into())
        );
        let cfg = Config {
            env: vec!["=v".into()],
            ..Config::default()
        };
        assert_eq!(
            archive("x:dev", &Tree::new(), &cfg).unwrap_err(),
            ImageError::BadEnv("=v".into())
        );
    }
}
