//! One-layer OCI images written as an OCI image layout in a tar archive, the form
//! `ctr images import` reads. The layer is uncompressed (nothing to gain on a local import, and
//! no compressor whose output could change between versions); `index.json` names the image in
//! both annotations containerd looks at, so the import tags it with the full reference. An image
//! may have several references (one index entry each, all for the same manifest), as a registry
//! image has several tags: Istio's charts name theirs `<tag>-<variant>`.

use ring::digest::{SHA256, digest};
use serde_json::{Value, json};

use crate::tar::Tree;

const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
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
    let name_ok = !name.is_empty()
        && name.split('/').all(|c| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        });
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

fn sha256(data: &[u8]) -> String {
    let d = digest(&SHA256, data);
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn descriptor(media_type: &str, blob: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": sha256(blob), "size": blob.len()})
}

fn blob_path(blob: &[u8]) -> String {
    format!("/blobs/sha256/{}", &sha256(blob)["sha256:".len()..])
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
    let image_config = to_bytes(&json!({
        "architecture": host_arch(),
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
    let entries: Vec<Value> = references
        .iter()
        .map(|reference| {
            let mut entry = descriptor(MANIFEST_TYPE, &manifest);
            entry["platform"] = json!({"architecture": host_arch(), "os": "linux"});
            entry["annotations"] = json!({CONTAINERD_NAME: reference, OCI_REF_NAME: reference});
            entry
        })
        .collect();
    let index = to_bytes(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": entries,
    }));

    let mut out = Tree::new();
    let file = |t: &mut Tree, path: &str, data: &[u8]| {
        // Distinct blobs never share a path; equal ones (impossible here) would be one blob.
        t.file(path, 0o644, data.to_vec())
            .expect("layout paths are fixed and distinct")
    };
    file(
        &mut out,
        "/oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    );
    file(&mut out, "/index.json", &index);
    for blob in [&layer, &image_config, &manifest] {
        file(&mut out, &blob_path(blob), blob);
    }
    Ok((out.to_tar(), sha256(&manifest)))
}

fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("JSON values always serialise")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(archive: &[u8]) -> std::collections::BTreeMap<String, Vec<u8>> {
        // The archive's own entries, through the same reader the tar tests use, by path.
        let mut out = std::collections::BTreeMap::new();
        let mut at = 0;
        while archive[at..at + 512].iter().any(|&b| b != 0) {
            let h = &archive[at..at + 512];
            let end = h[..100].iter().position(|&c| c == 0).unwrap();
            let name = String::from_utf8(h[..end].to_vec()).unwrap();
            let size_text = String::from_utf8(h[124..135].to_vec()).unwrap();
            let size = usize::from_str_radix(&size_text, 8).unwrap();
            out.insert(name, archive[at + 512..at + 512 + size].to_vec());
            at += 512 + size.next_multiple_of(512);
        }
        out
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
