//! The `Dockerfile`'s image and the engine-free one `scripts/node-images` builds (its
//! `install-cni` image) must be the same image: read from the two files, they must put our
//! binaries at the same paths, start the same way (entrypoint, working directory, `PATH`), and
//! carry the same Debian netfilter packages. The Dockerfile installs whole packages; node-images
//! packs their binaries (with their links, modules and libraries), so each binary it packs must
//! belong to a package the Dockerfile installs, and each package must provide one of them. The
//! stage the final image copies from must run on the builder's platform (`FROM
//! --platform=$BUILDPLATFORM`), so a multi-arch build cross-compiles instead of running under QEMU.
//!
//! Needs `dpkg` and Debian's iptables, ipset and nftables installed (`scripts/setup`).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;
use testbed::manifests::repo_file;

/// An image as a build file describes it.
#[derive(Debug, Default, PartialEq)]
struct Layout {
    /// Paths of the files built from this repository.
    ours: BTreeSet<String>,
    entrypoint: Option<Value>,
    workdir: Option<String>,
    env: BTreeMap<String, String>,
}

/// Lines with their `\` continuations joined, comments and blank lines dropped.
fn logical_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if cur.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                cur.push_str(part);
                cur.push(' ');
            }
            None => {
                cur.push_str(trimmed);
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Words as the shell splits them: whitespace outside quotes separates, quotes are removed
/// (no expansion).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur: Option<String> = None;
    let mut quote = None;
    for c in line.chars() {
        match (quote, c) {
            (None, '\'' | '"') => {
                quote = Some(c);
                cur.get_or_insert_with(String::new);
            }
            (Some(q), _) if c == q => quote = None,
            (None, c) if c.is_whitespace() => words.extend(cur.take()),
            (_, c) => cur.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(cur);
    words
}

/// What the Dockerfile says of its final image: its layout, the Debian packages it installs, and
/// whether every stage it copies from runs on `$BUILDPLATFORM`.
struct Dockerfile {
    layout: Layout,
    packages: BTreeSet<String>,
    build_stage_on_build_platform: bool,
}

fn parse_dockerfile(text: &str) -> Dockerfile {
    // Stages: the FROM line's words, then the stage's instructions.
    let mut stages: Vec<(Vec<String>, Vec<String>)> = Vec::new();
    for line in logical_lines(text) {
        let words = shell_words(&line);
        if words
            .first()
            .is_some_and(|w| w.eq_ignore_ascii_case("FROM"))
        {
            stages.push((words, Vec::new()));
        } else if let Some((_, body)) = stages.last_mut() {
            body.push(line);
        }
    }
    let (_, last) = stages.last().expect("the Dockerfile has no FROM");
    let mut layout = Layout::default();
    let mut packages = BTreeSet::new();
    let mut from_stages = BTreeSet::new();
    for line in last {
        let (instr, rest) = line.split_once(' ').unwrap_or((line, ""));
        let rest = rest.trim();
        match instr.to_ascii_uppercase().as_str() {
            "COPY" => {
                let words = shell_words(rest);
                let from = words.iter().find_map(|w| w.strip_prefix("--from="));
                let from = from.unwrap_or_else(|| {
                    panic!("Dockerfile: the final stage copies from the build context: {line}")
                });
                from_stages.insert(from.to_string());
                layout.ours.insert(words.last().unwrap().clone());
            }
            "ENTRYPOINT" => {
                layout.entrypoint = Some(
                    serde_json::from_str(rest)
                        .unwrap_or_else(|e| panic!("Dockerfile: ENTRYPOINT is not JSON ({e})")),
                )
            }
            "WORKDIR" => layout.workdir = Some(rest.to_string()),
            "ENV" => {
                for w in shell_words(rest) {
                    let (k, v) = w.split_once('=').expect("ENV in KEY=value form");
                    layout.env.insert(k.to_string(), v.to_string());
                }
            }
            "RUN" => {
                let words = shell_words(rest);
                for (i, pair) in words.windows(2).enumerate() {
                    if pair[0] == "apt-get" && pair[1] == "install" {
                        packages.extend(
                            words[i + 2..]
                                .iter()
                                .take_while(|w| !w.starts_with('>') && *w != "&&")
                                .filter(|w| !w.starts_with('-'))
                                .cloned(),
                        );
                    }
                }
            }
            _ => {}
        }
    }
    // `FROM [--platform=...] <image> AS <name>`
    let on_build_platform = |name: &str| {
        stages.iter().any(|(from, _)| match from.as_slice() {
            [.., as_, stage] if as_.eq_ignore_ascii_case("AS") && stage == name => {
                from.iter().any(|w| w == "--platform=$BUILDPLATFORM")
            }
            _ => false,
        })
    };
    Dockerfile {
        layout,
        packages,
        build_stage_on_build_platform: !from_stages.is_empty()
            && from_stages.iter().all(|s| on_build_platform(s)),
    }
}

/// The `install-cni` image of scripts/node-images: the options of its oci-archive command, and
/// the binaries its `netfilter_tools` packs.
struct NodeImage {
    layout: Layout,
    netfilter_bins: Vec<String>,
}

fn parse_node_images(text: &str) -> NodeImage {
    let lines = logical_lines(text);
    let arm = lines
        .iter()
        .position(|l| l == "install-cni)")
        .expect("scripts/node-images: no `install-cni)` case");
    let end = arm
        + lines[arm..]
            .iter()
            .position(|l| l == ";;")
            .expect("scripts/node-images: the install-cni case has no `;;`");
    let command = lines[arm..end]
        .iter()
        .find(|l| l.starts_with("\"$tool\""))
        .expect("scripts/node-images: the install-cni case runs no \"$tool\"");
    let words = shell_words(command);
    let mut layout = Layout::default();
    let mut netfilter = false;
    let mut i = 1;
    while i < words.len() {
        let (opt, val) = (words[i].as_str(), words.get(i + 1).map(String::as_str));
        match (opt, val) {
            ("--file", Some(v)) => {
                let (dest, src) = v.split_once('=').expect("--file DEST=SRC");
                if src.starts_with("$bindir/") {
                    layout.ours.insert(dest.to_string());
                }
            }
            ("--env", Some(v)) => {
                let (k, v) = v.split_once('=').expect("--env KEY=value");
                layout.env.insert(k.to_string(), v.to_string());
            }
            ("--workdir", Some(v)) => layout.workdir = Some(v.to_string()),
            ("--entrypoint", Some(v)) => {
                layout.entrypoint = Some(serde_json::from_str(v).expect("--entrypoint JSON"))
            }
            ("${nf[@]}", _) => {
                netfilter = true;
                i += 1;
                continue;
            }
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    assert!(
        netfilter,
        "scripts/node-images: the install-cni image does not pack the netfilter tools"
    );
    let sbin = lines
        .iter()
        .find_map(|l| l.strip_prefix("local sbin="))
        .and_then(|l| l.split_whitespace().next())
        .expect("scripts/node-images: netfilter_tools sets no `local sbin=`")
        .to_string();
    let bins = lines
        .iter()
        .find_map(|l| l.strip_prefix("local -a bins=("))
        .and_then(|l| l.strip_suffix(')'))
        .expect("scripts/node-images: netfilter_tools has no `local -a bins=(...)`");
    let netfilter_bins = shell_words(bins)
        .iter()
        .map(|b| b.replace("$sbin", &sbin))
        .collect();
    NodeImage {
        layout,
        netfilter_bins,
    }
}

/// The Debian package that installed `path`.
fn owning_package(path: &str) -> String {
    let out = Command::new("dpkg")
        .args(["-S", path])
        .output()
        .unwrap_or_else(|e| panic!("dpkg -S {path}: {e} (a Debian machine, or scripts/setup)"));
    assert!(
        out.status.success(),
        "dpkg -S {path}: no package installed it ({}); apt-get install iptables ipset nftables",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let (package, _) = text
        .split_once(':')
        .expect("dpkg -S prints `package: path`");
    package.to_string()
}

#[test]
fn dockerfile_image_is_the_engine_free_image() {
    let read =
        |p: &str| std::fs::read_to_string(repo_file(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let docker = parse_dockerfile(&read("Dockerfile"));
    let node = parse_node_images(&read("scripts/node-images"));

    assert!(
        docker.build_stage_on_build_platform,
        "Dockerfile: the stage the image copies from must be `FROM --platform=$BUILDPLATFORM ... AS <name>`"
    );
    assert!(
        !node.layout.ours.is_empty(),
        "node-images packs none of our binaries"
    );
    assert_eq!(
        docker.layout, node.layout,
        "the Dockerfile's final stage (left) and scripts/node-images' install-cni image (right) differ"
    );

    let from_node_images: BTreeSet<String> = node
        .netfilter_bins
        .iter()
        .map(|b| owning_package(b))
        .collect();
    assert_eq!(
        docker.packages, from_node_images,
        "the Debian packages the Dockerfile installs (left) and those owning the netfilter \
         binaries node-images packs, {:?} (right)",
        node.netfilter_bins
    );
}

/// The parsers see what differs: a missing copy, another entrypoint, a build stage on the target
/// platform.
#[test]
fn the_parsers_see_a_different_image() {
    let good = "FROM --platform=$BUILDPLATFORM rust AS build\n\
                RUN make\n\
                FROM debian\n\
                RUN apt-get update \\\n && apt-get install -y --no-install-recommends a b >/dev/null\n\
                COPY --from=build /out/x /usr/local/bin/x\n\
                ENV PATH=/bin:/usr/bin\n\
                WORKDIR /w\n\
                ENTRYPOINT [\"x\"]\n";
    let d = parse_dockerfile(good);
    assert!(d.build_stage_on_build_platform);
    assert_eq!(
        d.packages,
        BTreeSet::from(["a".to_string(), "b".to_string()])
    );
    let node = "build() {\n\
                local sbin=/usr/sbin arch\n\
                local -a bins=(\"$sbin/a\" \"$sbin/b\")\n\
                case x in\n\
                  install-cni)\n\
                    \"$tool\" --ref r --out o \\\n\
                      --file /usr/local/bin/x=\"$bindir/x\" \"${nf[@]}\" --dir /tmp=1777 \\\n\
                      --env PATH=/bin:/usr/bin --workdir /w --entrypoint '[\"x\"]'\n\
                    ;;\n\
                esac\n}\n";
    let n = parse_node_images(node);
    assert_eq!(d.layout, n.layout);
    assert_eq!(n.netfilter_bins, ["/usr/sbin/a", "/usr/sbin/b"]);

    let other = parse_dockerfile(&good.replace("ENTRYPOINT [\"x\"]", "ENTRYPOINT [\"y\"]"));
    assert_ne!(other.layout, n.layout);
    let missing =
        parse_dockerfile(&good.replace("COPY --from=build /out/x /usr/local/bin/x\n", ""));
    assert_ne!(missing.layout, n.layout);
    let emulated = parse_dockerfile(&good.replace("--platform=$BUILDPLATFORM ", ""));
    assert!(!emulated.build_stage_on_build_platform);
}
