//! CNCF distribution's `registry` (built from its Go module by `tools/registry/build.sh`, cached)
//! serving plain HTTP on a loopback port, with its storage in a temp dir: where a test pushes a
//! release and a node pulls it from, as a user's registry would serve it. Killed on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::ports;

pub struct Registry {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

/// The registry binary (built on first use).
pub fn binary() -> PathBuf {
    crate::manifests::built_tool("tools/registry/build.sh")
}

impl Registry {
    /// Starts the registry on a free loopback port and waits until it answers `GET /v2/`; a
    /// port taken meanwhile by another process is replaced by a fresh one.
    pub fn start() -> Registry {
        let bin = binary();
        for _ in 0..ports::START_ATTEMPTS {
            let dir = tempfile::tempdir().unwrap();
            let port = ports::unused();
            let config = dir.path().join("config.yml");
            std::fs::write(
                &config,
                format!(
                    "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                     http:\n  addr: 127.0.0.1:{port}\n",
                    dir.path().join("data").display()
                ),
            )
            .unwrap();
            let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
            let child = Command::new(&bin)
                .arg("serve")
                .arg(&config)
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
            let mut registry = Registry { child, port, dir };
            if registry.wait_ready() {
                return registry;
            }
        }
        panic!(
            "the registry could not bind a port {} times",
            ports::START_ATTEMPTS
        );
    }

    /// True once `/v2/` answers 200; false when the registry exited (its port was taken).
    fn wait_ready(&mut self) -> bool {
        // A start-up deadline, not a speed assertion: a registry that never answers is broken.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                let log = std::fs::read_to_string(self.dir.path().join("registry.log"))
                    .unwrap_or_default();
                assert!(
                    log.contains("address already in use"),
                    "the registry exited ({status}):\n{log}"
                );
                return false;
            }
            if self
                .get("/v2/")
                .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "the registry on 127.0.0.1:{} did not answer /v2/",
            self.port
        );
    }

    /// `127.0.0.1:<port>`, what `docker://`, `oci://` and a hub start with.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where the registry stores blob (or manifest) `digest` (`sha256:<hex>`): the bytes it serves
    /// for that digest, read from this file at each request.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest
            .strip_prefix("sha256:")
            .unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// A plain GET's whole response, or None if nothing answers.
    fn get(&self, path: &str) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/vnd.oci.image.index.v1+json\r\n\
             Connection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
