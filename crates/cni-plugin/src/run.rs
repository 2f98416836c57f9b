//! The process contract: env + stdin in, result or error JSON on stdout, exit 0 or 1. Logs never
//! touch stdout.

use std::io::{Read, Write};

use cni_core::cni::env::{about_text, check_stdin, read_env};
use cni_core::cni::error::code;
use cni_core::cni::version::version_info_json;
use cni_core::cni::{CmdArgs, CniError, Command, EnvSource, Invocation};
use cni_core::plugin_conf::PluginConf;

use crate::log::Log;

/// A network config with its `prevResult` is a few KiB; this bounds what a broken or hostile
/// caller can make the plugin buffer and parse (libcni itself reads stdin unbounded).
const MAX_STDIN: u64 = 4 << 20;

enum Output {
    Stdout(Vec<u8>),
    Stderr(String),
}

pub fn main(env: &dyn EnvSource) -> i32 {
    // A panic is a bug, but the runtime must still get a CNI error on stdout and exit 1. A hook,
    // not catch_unwind: release builds abort on panic (Cargo.toml) and never unwind to a catch.
    std::panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let what = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("unknown panic");
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let e = CniError::internal(format!("istio-cni panicked: {what}{at}"));
        let _ = writeln!(std::io::stderr(), "{e}");
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(&e.to_json()).and_then(|()| out.flush());
        std::process::exit(1);
    }));
    let mut log = Log::default();
    let result = run(env, &mut log);
    let exit = match result {
        Ok(Output::Stdout(bytes)) => {
            let mut out = std::io::stdout().lock();
            if out.write_all(&bytes).and_then(|()| out.flush()).is_err() {
                1
            } else {
                0
            }
        }
        Ok(Output::Stderr(text)) => {
            let _ = std::io::stderr().lock().write_all(text.as_bytes());
            0
        }
        Err(e) => {
            log.error("istio-cni failed", &[("error", &e.to_string())]);
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(&e.to_json()).and_then(|()| out.flush());
            1
        }
    };
    log.flush_to_agent();
    exit
}

fn run(env: &dyn EnvSource, log: &mut Log) -> Result<Output, CniError> {
    let (command, args) = match read_env(env)? {
        Invocation::About => {
            let about = format!("CNI plugin istio-cni {}", env!("CARGO_PKG_VERSION"));
            return Ok(Output::Stderr(about_text(&about)));
        }
        Invocation::Run {
            command: Command::Version,
            ..
        } => {
            return Ok(Output::Stdout(version_info_json().into_bytes()));
        }
        Invocation::Run { command, args } => (command, args),
    };
    let mut stdin = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_STDIN + 1)
        .read_to_end(&mut stdin)
        .map_err(|e| CniError::new(code::IO_FAILURE, format!("error reading from stdin: {e}")))?;
    if stdin.len() as u64 > MAX_STDIN {
        return Err(CniError::new(
            code::DECODING_FAILURE,
            format!(
                "network config on stdin is larger than {} MiB",
                MAX_STDIN >> 20
            ),
        ));
    }
    let conf_version = check_stdin(&command, &stdin)?;
    match command {
        Command::Add => {
            let out = crate::add::cmd_add(&args, &stdin, &conf_version, log)?;
            check_netns(&args)?;
            Ok(Output::Stdout(out))
        }
        Command::Del => {
            // Pod removal is the agent's job (its pod informer); DEL only checks and succeeds.
            if let Ok(conf) = PluginConf::parse(&stdin) {
                log.configure(&conf.plugin_log_level, conf.run_dir());
            }
            check_netns(&args)?;
            Ok(Output::Stdout(Vec::new()))
        }
        _ => Ok(Output::Stdout(Vec::new())),
    }
}

/// libcni refuses a `CNI_NETNS` that is the plugin's own namespace (a runtime bug that would have
/// the plugin act on the host) unless `CNI_NETNS_OVERRIDE` allows it. A netns that cannot be
/// opened is not an error here (DEL of a sandbox whose netns is already gone).
fn check_netns(args: &CmdArgs) -> Result<(), CniError> {
    use std::os::unix::fs::MetadataExt as _;
    if args.netns_override() || args.netns.is_empty() {
        return Ok(());
    }
    let Ok(theirs) = std::fs::metadata(&args.netns) else {
        return Ok(());
    };
    let ours = std::fs::metadata("/proc/self/ns/net")
        .map_err(|_| CniError::new(code::INVALID_NETNS, "get plugin's netns failed"))?;
    if (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino()) {
        return Err(CniError::new(
            code::INVALID_NETNS,
            "plugin's netns and netns from CNI_NETNS should not be the same",
        ));
    }
    Ok(())
}
