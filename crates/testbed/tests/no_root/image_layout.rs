//! The `Dockerfile`'s image and the engine-free one (`scripts/node-images` and `scripts/release`
//! build it with the arguments `agent_image_args` of `scripts/lib/agent-image.sh` prints) must be
//! the same image: they must put our binaries at the same paths, start the same way (entrypoint,
//! working directory, `PATH`), and carry the same Debian netfilter packages. The Dockerfile
//! installs whole packages; the engine-free image packs their binaries (with their links,
//! modules and libraries), so each binary it packs must belong to a package the Dockerfile
//! installs, and each package must provide one of them. The stage the final image copies from
//! must run on the builder's platform (`FROM --platform=$BUILDPLATFORM`), so a multi-arch build
//! cross-compiles instead of running under QEMU.
//!
//! Needs bash, `dpkg` and Debian's iptables, ipset and nftables installed (`scripts/setup`).

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

/// The engine-free agent image, as its oci-archive arguments say.
struct EngineFree {
    layout: Layout,
    /// The `/usr/sbin` binaries it packs.
    netfilter_bins: Vec<String>,
}

/// Where [`engine_free_image`] says our binaries are: they are not built here.
const BINDIR: &str = "/our-binaries";

/// The arguments `agent_image_args` prints for this machine's netfilter tools, with its checks
/// that our binaries are static and packed replaced (there are none at [`BINDIR`]).
fn engine_free_image() -> EngineFree {
    let script = format!(
        "set -euo pipefail; me=image_layout; source scripts/lib/agent-image.sh; \
         static() {{ :; }}; packed() {{ :; }}; \
         agent_image_args {BINDIR} '' \"$(uname -m)-linux-gnu\""
    );
    let out = Command::new("bash")
        .args(["-c", &script])
        .current_dir(repo_file(""))
        .output()
        .expect("run bash");
    assert!(
        out.status.success(),
        "agent_image_args (scripts/lib/agent-image.sh) failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_archive_args(&String::from_utf8(out.stdout).unwrap())
}

/// oci-archive arguments, one a line.
fn parse_archive_args(text: &str) -> EngineFree {
    let words: Vec<&str> = text.lines().collect();
    let mut layout = Layout::default();
    let mut netfilter_bins = Vec::new();
    for pair in words.chunks(2) {
        let [opt, val] = pair else {
            panic!("agent_image_args: option {pair:?} has no value")
        };
        match *opt {
            "--file" => {
                let (dest, src) = val.split_once('=').expect("--file DEST=SRC");
                if src.starts_with(&format!("{BINDIR}/")) {
                    layout.ours.insert(dest.to_string());
                } else if dest.starts_with("/usr/sbin/") {
                    netfilter_bins.push(dest.to_string());
                }
            }
            "--env" => {
                let (k, v) = val.split_once('=').expect("--env KEY=value");
                layout.env.insert(k.to_string(), v.to_string());
            }
            "--workdir" => layout.workdir = Some(val.to_string()),
            "--entrypoint" => {
                layout.entrypoint = Some(serde_json::from_str(val).expect("--entrypoint JSON"))
            }
            "--symlink" | "--dir" => {}
            other => panic!("agent_image_args: unknown option {other}"),
        }
    }
    EngineFree {
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
    dataplane::enter_test_group!();
    let read =
        |p: &str| std::fs::read_to_string(repo_file(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let docker = parse_dockerfile(&read("Dockerfile"));
    let node = engine_free_image();

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
         binaries the engine-free image packs, {:?} (right)",
        node.netfilter_bins
    );
}

/// The parsers see what differs: a missing copy, another entrypoint, a build stage on the target
/// platform.
#[test]
fn the_parsers_see_a_different_image() {
    dataplane::enter_test_group!();
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
    let args = "--file\n/usr/local/bin/x=/our-binaries/x\n--file\n/usr/sbin/a=/usr/sbin/a\n\
                --symlink\n/usr/sbin/b=a\n--dir\n/tmp=1777\n--env\nPATH=/bin:/usr/bin\n\
                --workdir\n/w\n--entrypoint\n[\"x\"]\n";
    let n = parse_archive_args(args);
    assert_eq!(d.layout, n.layout);
    assert_eq!(n.netfilter_bins, ["/usr/sbin/a"]);

    let other = parse_dockerfile(&good.replace("ENTRYPOINT [\"x\"]", "ENTRYPOINT [\"y\"]"));
    assert_ne!(other.layout, n.layout);
    let missing =
        parse_dockerfile(&good.replace("COPY --from=build /out/x /usr/local/bin/x\n", ""));
    assert_ne!(missing.layout, n.layout);
    let emulated = parse_dockerfile(&good.replace("--platform=$BUILDPLATFORM ", ""));
    assert!(!emulated.build_stage_on_build_platform);
}
