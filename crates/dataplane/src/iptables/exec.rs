//! Running the iptables tools inside a namespace: the child is started in the pod netns and in
//! the xtables [`sandbox`](super::sandbox) (the caller's thread never moves), gets the lock
//! settings for the variant, and exit codes become readable errors.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::Stdio;

use super::detect::Binaries;
use super::sandbox;
use crate::netns::Netns;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot run {binary}: {source}")]
    Spawn {
        binary: String,
        source: std::io::Error,
    },
    /// Exit codes 1-4 are xtables' own classes of failure.
    #[error("{binary}: xtables {class} (exit {code}): {stderr}")]
    Failed {
        binary: String,
        code: i32,
        class: &'static str,
        stderr: String,
    },
    #[error("{binary} was killed by a signal: {stderr}")]
    Killed { binary: String, stderr: String },
}

impl ExecError {
    pub fn exit_code(&self) -> Option<i32> {
        match self {
            ExecError::Failed { code, .. } => Some(*code),
            _ => None,
        }
    }
}

fn class(code: i32) -> &'static str {
    match code {
        1 => "other problem",
        2 => "parameter problem",
        3 => "version problem",
        4 => "resource problem",
        _ => "failure",
    }
}

/// How to run a tool: which namespace, and the pod-scoped lock file (`None`: the node-wide one).
pub struct Runner<'a> {
    pub bins: &'a Binaries,
    pub netns: &'a Netns,
    pub lock_file: Option<PathBuf>,
}

impl Runner<'_> {
    /// Runs `tool` (`""`, `"-save"`, `"-restore"`) for the family with `args`, feeding `stdin`.
    pub fn run(
        &self,
        v6: bool,
        tool: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, ExecError> {
        let binary = self.bins.tool(v6, tool);
        let spawn_err = |source| ExecError::Spawn {
            binary: binary.clone(),
            source,
        };
        let mut cmd = self.netns.command(&binary).map_err(spawn_err)?;
        // Writers take the xtables lock; save never does.
        let locks = tool != "-save" && self.bins.wants_wait();
        if locks {
            cmd.arg("--wait=30");
        }
        cmd.args(args);
        // The pod's lock: named by env from legacy 1.8.6, bound over the global path before.
        let mut bind_lock = None;
        if let Some(lock) = self.lock_file.as_deref().filter(|_| locks) {
            if self.bins.scoped_lock() {
                cmd.env("XTABLES_LOCKFILE", lock);
            } else {
                bind_lock = Some(lock);
            }
        }
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = sandbox::spawn(self.netns, &mut cmd, bind_lock).map_err(spawn_err)?;
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().expect("stdin piped");
            // A tool that exits early closes the pipe; its exit status tells the real story.
            let _ = pipe.write_all(input.as_bytes());
        }
        let out = child.wait_with_output().map_err(spawn_err)?;
        let stderr = tail(&String::from_utf8_lossy(&out.stderr));
        match out.status.code() {
            Some(0) => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
            Some(code) => Err(ExecError::Failed {
                binary,
                code,
                class: class(code),
                stderr,
            }),
            None => Err(ExecError::Killed { binary, stderr }),
        }
    }
}

/// The last few lines of stderr: enough to name the failing line without flooding logs.
fn tail(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.trim().lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}
