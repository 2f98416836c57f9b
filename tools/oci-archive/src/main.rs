//! `oci-archive`: builds one single-layer OCI image archive from files on this machine and prints
//! `<ref> <archive>`; `oci-archive index` puts several (one per platform) behind one OCI image
//! index and prints `<ref> <archive> <index digest>`. Used by `scripts/node-images` and
//! `scripts/release`.
//!
//! ```text
//! oci-archive --ref localhost/istio-cni-rs/busybox:dev --out busybox.tar \
//!     --file /bin/busybox=/bin/busybox --symlink /bin/sh=busybox --dir /tmp=1777 \
//!     --entrypoint '["/bin/sh"]' --env PATH=/bin
//! oci-archive index --ref example.org/x/busybox:1.0 --out busybox.tar amd64.tar arm64.tar
//! ```

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use oci_archive::image::{self, Config};
use oci_archive::tar::Tree;

#[derive(Parser)]
#[command(
    about = "Write a single-layer OCI image archive for `ctr images import`",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    image: Option<Args>,
}

#[derive(Subcommand)]
enum Command {
    /// Put image archives, one per platform, behind one OCI image index.
    Index(IndexArgs),
}

#[derive(clap::Args)]
struct IndexArgs {
    /// Image reference, `<name>:<tag>`, of the index; repeat it for more tags.
    #[arg(long = "ref", required = true)]
    reference: Vec<String>,
    /// Archive to write (replaced atomically).
    #[arg(long)]
    out: PathBuf,
    /// `KEY=VALUE` annotation of the index (repeatable).
    #[arg(long, value_name = "KEY=VALUE")]
    annotation: Vec<String>,
    /// Image archives written by `oci-archive --platform …`, one per platform.
    #[arg(required = true)]
    archives: Vec<PathBuf>,
}

#[derive(clap::Args)]
struct Args {
    /// Image reference, `<name>:<tag>` (written to index.json); repeat it for more names of the
    /// same image.
    #[arg(long = "ref", required = true)]
    reference: Vec<String>,
    /// Archive to write (replaced atomically).
    #[arg(long)]
    out: PathBuf,
    /// `IMAGE_PATH=HOST_FILE`: a regular file, copied with its permission bits (symlinks followed).
    #[arg(long, value_name = "IMAGE_PATH=HOST_FILE")]
    file: Vec<String>,
    /// `IMAGE_PATH=TARGET`: a symlink.
    #[arg(long, value_name = "IMAGE_PATH=TARGET")]
    symlink: Vec<String>,
    /// `IMAGE_PATH=OCTAL_MODE`: a directory (parents of files are created 0755 anyway).
    #[arg(long, value_name = "IMAGE_PATH=OCTAL_MODE")]
    dir: Vec<String>,
    /// Entrypoint as a JSON array of strings.
    #[arg(long, value_name = "JSON")]
    entrypoint: Option<String>,
    /// Cmd as a JSON array of strings.
    #[arg(long, value_name = "JSON")]
    cmd: Option<String>,
    /// `NAME=VALUE` in the image's environment (repeatable).
    #[arg(long, value_name = "NAME=VALUE")]
    env: Vec<String>,
    #[arg(long)]
    workdir: Option<String>,
    /// The user the image runs as, `uid[:gid]`.
    #[arg(long)]
    user: Option<String>,
    /// `KEY=VALUE` label of the image config (repeatable).
    #[arg(long, value_name = "KEY=VALUE")]
    label: Vec<String>,
    /// `linux/<arch>` the files are built for (default: this machine's).
    #[arg(long)]
    platform: Option<String>,
}

fn pair<'a>(flag: &str, arg: &'a str) -> Result<(&'a str, &'a str)> {
    match arg.split_once('=') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a, b)),
        _ => bail!("--{flag} {arg:?}: expected IMAGE_PATH=VALUE"),
    }
}

fn key_values(flag: &str, args: &[String]) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for arg in args {
        match arg.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                if out.insert(k.to_string(), v.to_string()).is_some() {
                    bail!("--{flag} {arg:?}: {k} is given twice");
                }
            }
            _ => bail!("--{flag} {arg:?}: expected KEY=VALUE"),
        }
    }
    Ok(out)
}

fn architecture(platform: Option<&str>) -> Result<Option<String>> {
    platform
        .map(|p| match p.split_once('/') {
            Some(("linux", arch)) if !arch.contains('/') => Ok(arch.to_string()),
            _ => bail!("--platform {p:?}: expected linux/<arch> (linux/amd64, linux/arm64)"),
        })
        .transpose()
}

fn argv(flag: &str, json: Option<&str>) -> Result<Vec<String>> {
    json.map_or(Ok(Vec::new()), |j| {
        serde_json::from_str(j)
            .with_context(|| format!("--{flag} {j:?}: expected a JSON array of strings"))
    })
}

fn tree(args: &Args) -> Result<Tree> {
    let mut t = Tree::new();
    for arg in &args.dir {
        let (path, mode) = pair("dir", arg)?;
        let mode = u32::from_str_radix(mode, 8)
            .with_context(|| format!("--dir {arg:?}: mode is not octal"))?;
        t.dir(path, mode)
            .with_context(|| format!("--dir {arg:?}"))?;
    }
    for arg in &args.file {
        let (path, host) = pair("file", arg)?;
        let meta = std::fs::metadata(host).with_context(|| format!("--file {arg:?}: {host}"))?;
        if !meta.is_file() {
            bail!("--file {arg:?}: {host} is not a regular file");
        }
        let data =
            std::fs::read(host).with_context(|| format!("--file {arg:?}: reading {host}"))?;
        t.file(path, meta.permissions().mode(), data)
            .with_context(|| format!("--file {arg:?}"))?;
    }
    for arg in &args.symlink {
        let (path, target) = pair("symlink", arg)?;
        t.symlink(path, target)
            .with_context(|| format!("--symlink {arg:?}"))?;
    }
    Ok(t)
}

fn write_atomically(path: &Path, data: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("--out {}: not a file path", path.display()))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::write(&tmp, data).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

fn image(args: &Args) -> Result<()> {
    let config = Config {
        entrypoint: argv("entrypoint", args.entrypoint.as_deref())?,
        cmd: argv("cmd", args.cmd.as_deref())?,
        env: args.env.clone(),
        workdir: args.workdir.clone(),
        user: args.user.clone(),
        labels: key_values("label", &args.label)?,
        architecture: architecture(args.platform.as_deref())?,
    };
    let rootfs = tree(args)?;
    let refs: Vec<&str> = args.reference.iter().map(String::as_str).collect();
    let (archive, _manifest) = image::archive_named(&refs, &rootfs, &config)?;
    write_atomically(&args.out, &archive)?;
    for reference in &refs {
        println!("{reference} {}", args.out.display());
    }
    Ok(())
}

fn index(args: &IndexArgs) -> Result<()> {
    let archives = args
        .archives
        .iter()
        .map(|a| std::fs::read(a).with_context(|| format!("reading {}", a.display())))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&str> = args.reference.iter().map(String::as_str).collect();
    let annotations = key_values("annotation", &args.annotation)?;
    let (archive, digest) =
        image::index_archive(&refs, &archives, &annotations).map_err(|e| match e {
            image::ImageError::BadArchive { index, problem } => anyhow::anyhow!(
                "{}: {problem}",
                args.archives
                    .get(index)
                    .map_or_else(String::new, |a| a.display().to_string())
            ),
            e => e.into(),
        })?;
    write_atomically(&args.out, &archive)?;
    for reference in &refs {
        println!("{reference} {} {digest}", args.out.display());
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match &cli.command {
        Some(Command::Index(args)) => index(args),
        None => image(
            cli.image
                .as_ref()
                .expect("clap requires the image arguments"),
        ),
    }
}
