//! Parsing for `/proc` netns discovery: which pod a process belongs to (from `/proc/<pid>/cgroup`)
//! and how old it is (from `/proc/<pid>/stat`).
//!
//! The pod matching follows the rules Istio inherited from SPIRE, written out by hand instead of
//! with regexes:
//! 1. `<punct>pod<uid><punct>` followed by punctuation-separated segments; the last segment is the
//!    container ID. `<uid>` is 8-4-4-4-12 hex digits with an optional punctuation character between
//!    groups (systemd writes `_`, cgroupfs `-`).
//! 2. CRI-O paths without a pod UID: the path ends in `crio<punct><container id>`, and the match
//!    must not begin with a `pod<uid><punct>` (such paths belong to rule 1).
//!
//! A path both rules accept is ambiguous and ignored. A trailing `.scope` is trimmed first.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CgroupError {
    #[error("cgroup entry contains {colons} colons, but expected at least 2 colons: {line:?}")]
    Malformed { colons: usize, line: String },
    #[error("multiple container IDs found in cgroups ({0}, {1})")]
    MultipleContainerIds(String, String),
    #[error("multiple pod UIDs found in cgroups ({0}, {1})")]
    MultiplePodUids(String, String),
    #[error("invalid stat format: {0}")]
    Stat(&'static str),
}

/// What a process's cgroups say about it. `pod_uid` is empty for CRI-O paths that carry no UID.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PodContainer {
    pub pod_uid: String,
    pub container_id: String,
}

/// Returns the process start time (field 22 of `/proc/<pid>/stat`, clock ticks since boot). The
/// command name (field 2) may contain spaces and parentheses, so fields are counted after the
/// last `)`.
pub fn parse_starttime(stat: &str) -> Result<u64, CgroupError> {
    let close = stat
        .rfind(')')
        .ok_or(CgroupError::Stat("no ')' after the command name"))?;
    let field = stat[close + 1..]
        .split_whitespace()
        .nth(19)
        .ok_or(CgroupError::Stat("not enough fields"))?;
    field
        .parse()
        .map_err(|_| CgroupError::Stat("starttime is not a number"))
}

/// Parses the content of `/proc/<pid>/cgroup`. `Ok(None)` means no line names a container.
pub fn parse_cgroups(content: &str) -> Result<Option<PodContainer>, CgroupError> {
    let mut paths = Vec::new();
    for line in content.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(_), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(CgroupError::Malformed {
                colons: line.matches(':').count(),
                line: line.to_string(),
            });
        };
        paths.push(path);
    }
    pod_container_from_paths(paths)
}

/// Combines per-path matches: the first match wins, and any later match must agree with it.
pub fn pod_container_from_paths<'a>(
    paths: impl IntoIterator<Item = &'a str>,
) -> Result<Option<PodContainer>, CgroupError> {
    let mut found: Option<PodContainer> = None;
    for path in paths {
        let Some(candidate) = match_path(path) else {
            continue;
        };
        match &found {
            None => found = Some(candidate),
            Some(first) if first.container_id != candidate.container_id => {
                return Err(CgroupError::MultipleContainerIds(
                    first.container_id.clone(),
                    candidate.container_id,
                ));
            }
            Some(first) if first.pod_uid != candidate.pod_uid => {
                return Err(CgroupError::MultiplePodUids(
                    first.pod_uid.clone(),
                    candidate.pod_uid,
                ));
            }
            Some(_) => {}
        }
    }
    Ok(found)
}

/// Matches one cgroup path against both rules.
pub fn match_path(path: &str) -> Option<PodContainer> {
    let path = path.strip_suffix(".scope").unwrap_or(path);
    let with_uid = match_pod_uid_rule(path.as_bytes());
    let crio = match_crio_rule(path.as_bytes());
    match (with_uid, crio) {
        (Some(m), None) => Some(m),
        (None, Some(container_id)) => Some(PodContainer {
            pod_uid: String::new(),
            container_id,
        }),
        _ => None,
    }
}

// POSIX [[:punct:]] in the C locale: ASCII punctuation and symbols. Anything else (including
// non-ASCII) counts as "not punctuation", as in RE2.
fn is_punct(b: u8) -> bool {
    b.is_ascii_punctuation()
}

/// Length of `<uid>` at the start of `s` (8-4-4-4-12 hex, optional punct between groups).
fn uid_len(s: &[u8]) -> Option<usize> {
    let mut i = 0;
    for (n, group) in [8usize, 4, 4, 4, 12].into_iter().enumerate() {
        if n > 0 && s.get(i).copied().is_some_and(is_punct) {
            i += 1;
        }
        let hex = s.get(i..i + group)?;
        if !hex.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        i += group;
    }
    Some(i)
}

/// Length of `pod<uid><punct>` at the start of `s`, and of the `<uid>` in it.
fn pod_uid_prefix_len(s: &[u8]) -> Option<(usize, usize)> {
    let rest = s.strip_prefix(b"pod")?;
    let uid = uid_len(rest)?;
    rest.get(uid).copied().filter(|&b| is_punct(b))?;
    Some((3 + uid + 1, uid))
}

/// `^(?:[^P]+P)*([^P]+)$`: returns the last segment, the container ID.
fn trailing_container_id(s: &[u8]) -> Option<&[u8]> {
    if s.is_empty() || is_punct(s[0]) || is_punct(s[s.len() - 1]) {
        return None;
    }
    if s.windows(2).any(|w| is_punct(w[0]) && is_punct(w[1])) {
        return None;
    }
    let start = s.iter().rposition(|&b| is_punct(b)).map_or(0, |p| p + 1);
    Some(&s[start..])
}

fn match_pod_uid_rule(path: &[u8]) -> Option<PodContainer> {
    // Leftmost match: the first `<punct>pod` from which the whole rule matches.
    (0..path.len()).find_map(|s| {
        if !is_punct(path[s]) {
            return None;
        }
        let (prefix, uid) = pod_uid_prefix_len(&path[s + 1..])?;
        let container = trailing_container_id(&path[s + 1 + prefix..])?;
        let uid = &path[s + 4..s + 4 + uid];
        Some(PodContainer {
            pod_uid: canonical_uid(uid),
            container_id: String::from_utf8_lossy(container).into_owned(),
        })
    })
}

fn match_crio_rule(path: &[u8]) -> Option<String> {
    let id_start = path.iter().rposition(|&b| is_punct(b))? + 1;
    if id_start == path.len() {
        return None;
    }
    let crio = id_start.checked_sub(5)?;
    if &path[crio..crio + 4] != b"crio" {
        return None;
    }
    // The unanchored rule matches from the leftmost start that reaches `crio` through
    // non-punctuation and `/` only, optionally after a `pod<uid><punct>` at that start; when
    // that leftmost start begins with `pod<uid><punct>` the path has a UID and is not CRI-O's.
    let run_start = path[..crio]
        .iter()
        .rposition(|&b| is_punct(b) && b != b'/')
        .map_or(0, |p| p + 1);
    for s in 0..=run_start {
        if let Some((len, _)) = pod_uid_prefix_len(&path[s..]) {
            let end = s + len;
            if (run_start..=crio).contains(&end) {
                return None;
            }
        }
    }
    Some(String::from_utf8_lossy(&path[id_start..]).into_owned())
}

// Go's unicode.IsPunct, restricted to ASCII: symbols such as `+` or `$` are not punctuation.
fn canonical_uid(uid: &[u8]) -> String {
    uid.iter()
        .map(|&b| match b {
            b'!' | b'"' | b'#' | b'%' | b'&' | b'\'' | b'(' | b')' | b'*' | b',' | b'-' | b'.'
            | b'/' | b':' | b';' | b'?' | b'@' | b'[' | b'\\' | b']' | b'_' | b'{' | b'}' => '-',
            other => other as char,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CID: &str = "9bca8d63d5fa610783847915bcff0ecac1273e5b4bed3f6fa1b07350e0135961";
    const UID: &str = "2c48913c-b29f-11e7-9350-020968147796";

    fn pc(uid: &str, cid: &str) -> Option<PodContainer> {
        Some(PodContainer {
            pod_uid: uid.into(),
            container_id: cid.into(),
        })
    }

    #[test]
    fn istio_get_container_id_cases() {
        assert_eq!(pod_container_from_paths([]), Ok(None));
        assert_eq!(pod_container_from_paths(["/user.slice"]), Ok(None));
        let one = format!("/kubepods/pod{UID}/{CID}");
        assert_eq!(
            pod_container_from_paths(["/user.slice", one.as_str()]),
            Ok(pc(UID, CID))
        );
        let underscored = format!("/kubepods/pod{}/{CID}", UID.replace('-', "_"));
        assert_eq!(
            pod_container_from_paths(["/user.slice", underscored.as_str()]),
            Ok(pc(UID, CID))
        );
        let crio =
            "0::/../crio-45490e76e0878aaa4d9808f7d2eefba37f093c3efbba9838b6d8ab804d9bd814.scope";
        assert_eq!(
            pod_container_from_paths([crio]),
            Ok(pc(
                "",
                "45490e76e0878aaa4d9808f7d2eefba37f093c3efbba9838b6d8ab804d9bd814"
            ))
        );
        let other_cid = "a55d9ac3b312d8a2627824b6d6dd8af66fbec439bf4e0ec22d6d9945ad337a38";
        let two = format!("/kubepods/kubepods/besteffort/pod{UID}/{other_cid}");
        assert_eq!(
            pod_container_from_paths(["/user.slice", one.as_str(), two.as_str()])
                .unwrap_err()
                .to_string(),
            format!("multiple container IDs found in cgroups ({CID}, {other_cid})")
        );
        let a = format!("/kubepods/pod11111111-b29f-11e7-9350-020968147796/{CID}");
        let b =
            format!("/kubepods/kubepods/besteffort/pod22222222-b29f-11e7-9350-020968147796/{CID}");
        assert_eq!(
            pod_container_from_paths(["/user.slice", a.as_str(), b.as_str()])
                .unwrap_err()
                .to_string(),
            "multiple pod UIDs found in cgroups (11111111-b29f-11e7-9350-020968147796, \
             22222222-b29f-11e7-9350-020968147796)"
        );
    }

    #[test]
    fn runtime_layouts() {
        // cgroupfs driver, nested in a docker-in-docker node.
        let p = "/docker/8d461fa5765781bcf5f7eb192f101bc3103d4b932e26236f43feecfa20664f96/kubepods/besteffort/\
                 poddaa5c7ee-3484-4533-af39-3591564fd03e/aff34703e5e1f89443e9a1bffcc80f43f74d4808a2dd22c8f88c08547b323934";
        assert_eq!(
            match_path(p),
            pc(
                "daa5c7ee-3484-4533-af39-3591564fd03e",
                "aff34703e5e1f89443e9a1bffcc80f43f74d4808a2dd22c8f88c08547b323934"
            )
        );
        // systemd driver with docker.
        let p = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/docker-{CID}.scope",
            UID.replace('-', "_")
        );
        assert_eq!(match_path(&p), pc(UID, CID));
        // systemd driver with containerd (colon-separated cri-containerd unit).
        let p = "/kubepods-besteffort-pod72f7f152_440c_66ac_9084_e0fc1d8a910c.slice:cri-containerd:\
                 b2a102854b4969b2ce98dc329c86b4fb2b06e4ad2cc8da9d8a7578c9cd2004a2";
        assert_eq!(
            match_path(p),
            pc(
                "72f7f152-440c-66ac-9084-e0fc1d8a910c",
                "b2a102854b4969b2ce98dc329c86b4fb2b06e4ad2cc8da9d8a7578c9cd2004a2"
            )
        );
        // CRI-O under systemd with a pod slice: rule 1 only, so the UID is kept.
        let p = format!(
            "/kubepods.slice/kubepods-pod{}.slice/crio-{CID}.scope",
            UID.replace('-', "_")
        );
        assert_eq!(match_path(&p), pc(UID, CID));
        // cgroup namespaces hide the hierarchy.
        assert_eq!(match_path(&format!("/../../pod{UID}/{CID}")), pc(UID, CID));
        // Undashed UID stays undashed.
        assert_eq!(
            match_path(&format!(
                "/kubepods/pod2c48913cb29f11e79350020968147796/{CID}"
            )),
            pc("2c48913cb29f11e79350020968147796", CID)
        );
    }

    #[test]
    fn non_matches() {
        for p in [
            "/",
            "/system.slice/containerd.service",
            "/kubepods/besteffort/pod2c48913c-b29f-11e7-9350-020968147796",
            "/kubepods/besteffort/pod2c48913c-b29f-11e7-9350-020968147796/",
            "/kubepods/pod2c48913c-b29f-11e7-9350-02096814779/abc",
            "/kubepods/pod2c48913c-b29f-11e7-9350-020968147796//abc",
            "/crio-",
            "/crio",
        ] {
            assert_eq!(match_path(p), None, "{p}");
        }
        // Both rules accept an undashed UID followed by crio-: ambiguous, ignored.
        assert_eq!(
            match_path(&format!(
                "/kubepods/pod2c48913cb29f11e79350020968147796/crio-{CID}"
            )),
            None
        );
    }

    #[test]
    fn cgroup_file_parsing() {
        let content = format!(
            "12:pids:/kubepods/besteffort/pod{UID}/{CID}\n11:memory:/kubepods/besteffort/pod{UID}/{CID}\n\
             0::/kubepods/besteffort/pod{UID}/{CID}\n"
        );
        assert_eq!(parse_cgroups(&content), Ok(pc(UID, CID)));
        assert_eq!(parse_cgroups("0::/init.scope\n"), Ok(None));
        assert_eq!(parse_cgroups(""), Ok(None));
        assert_eq!(
            parse_cgroups("0::/a\nbroken\n"),
            Err(CgroupError::Malformed {
                colons: 0,
                line: "broken".into()
            })
        );
    }

    #[test]
    fn starttime_after_last_paren() {
        let stat = "1234 (we(ird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 70298968 \
                    1000 100 18446744073709551615";
        assert_eq!(parse_starttime(stat), Ok(70298968));
        assert!(parse_starttime("1234 no paren").is_err());
        assert!(parse_starttime("1 (x) S 1 2").is_err());
    }
}
