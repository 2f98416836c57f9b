//! The installer: puts the `istio-cni` plugin on the node and keeps it there.
//!
//! One pass ([`Installer::install_all`]) copies the binaries, writes the plugin kubeconfig and,
//! unless the on-disk config is already right, (re)writes the CNI config. [`Installer::run`] then
//! watches the conf dir, the installed binaries and the service account dir and repeats the pass
//! whenever something changes, throttled (see [`throttle`]). A pass that fails is retried in
//! place with backoff while readiness names the error ([`retry`]).
//!
//! Differences from Istio, on purpose:
//! - Chained mode without `CNI_CONF_NAME` follows the highest-priority config: when another CNI
//!   later drops a file that sorts first (or a primary `X.conf` reappears next to our converted
//!   `X.conflist`), our entry moves there and is removed from the old file, which is the state a
//!   fresh start would produce. Istio only warned and left the node unchained.
//! - The check compares our entry (and, for the owned file, the whole derived config) with what we
//!   would write, so a stale or edited entry is repaired, not only a missing one.
//! - Cleanup deletes a config file only when this installer wrote an owned or standalone file;
//!   an edited primary only loses our entry. Istio deleted the primary when `ISTIO_OWNED_CNI_CONFIG`
//!   was set without ambient.
//! - Symlinks in the conf and bin dirs are never followed (see [`crate::hostfs`]).
//! - A `.conf` primary is converted by writing `X.conflist` and then removing `X.conf`, so the
//!   runtime never sees list content under a `.conf` name.

pub mod binaries;
pub mod config;
pub mod discovery;
pub mod kubeconfig;
pub mod retry;
pub mod throttle;
pub mod watch;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cni_core::conflist::{self, ConfError, PLUGIN_TYPE};
use serde_json::Value;
use tokio::sync::watch as tokio_watch;

use crate::hostfs::{EntryKind, FileMode, HostDir, HostFsError};
use crate::metrics::{InstallResults, install_result};
use config::{ConfMode, InstallConfig};
use discovery::DiscoveryError;
use throttle::Throttle;
use watch::{FileWatch, WatchError};

/// Safety net for missed or impossible inotify watches (a conf dir that does not exist yet, queue
/// overflow): the config is re-checked this often even without events.
const RECHECK: Duration = Duration::from_secs(5);
/// Minimum spacing of reinstalls.
const THROTTLE_PERIOD: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("copying binaries: {0}")]
    Binaries(#[from] binaries::BinaryError),
    #[error("writing kubeconfig: {0}")]
    Kubeconfig(#[from] kubeconfig::KubeconfigError),
    #[error("CNI config {path}: {source}")]
    Conf { path: PathBuf, source: ConfError },
    #[error(transparent)]
    HostFs(#[from] HostFsError),
    #[error(transparent)]
    Watch(#[from] WatchError),
    #[error("cleanup: {}", .0.join("; "))]
    Cleanup(Vec<String>),
}

impl InstallError {
    /// Errors a retry cannot fix, which still end the installer: the agent's own configuration,
    /// and the inotify instance (a new process gets a new one, as Istio's agent does). Everything
    /// else is the host's files (a full disk, an I/O error, a directory replaced) and is retried.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            InstallError::Kubeconfig(
                kubeconfig::KubeconfigError::MissingHost | kubeconfig::KubeconfigError::MissingPort
            ) | InstallError::HostFs(HostFsError::BadName { .. })
                | InstallError::Watch(_)
        )
    }
}

/// The config file this installer wrote, and for the owned file, the primary it was derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub name: String,
    pub primary: Option<String>,
}

pub struct Installer {
    cfg: InstallConfig,
    written: Option<Written>,
    installed_bins: Vec<String>,
    ready: tokio_watch::Sender<bool>,
    /// The error of the failing pass being retried, `None` while passes succeed.
    failing: tokio_watch::Sender<Option<String>>,
    results: Option<InstallResults>,
}

/// `X.conf` ↔ `X.conflist`.
fn other_extension(name: &str) -> Option<String> {
    if let Some(base) = name.strip_suffix(".conflist") {
        Some(format!("{base}.conf"))
    } else {
        name.strip_suffix(".conf")
            .map(|base| format!("{base}.conflist"))
    }
}

fn json_eq(a: &[u8], b: &[u8]) -> bool {
    match (
        serde_json::from_slice::<Value>(a),
        serde_json::from_slice::<Value>(b),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

impl Installer {
    pub fn new(cfg: InstallConfig) -> Self {
        Installer {
            cfg,
            written: None,
            installed_bins: Vec::new(),
            ready: tokio_watch::Sender::new(false),
            failing: tokio_watch::Sender::new(None),
            results: None,
        }
    }

    /// Counts every pass in `istio_cni_installs_total{result}` as Istio does: `SUCCESS` each time
    /// the installation is verified and the watch starts, a failure label for the step that failed.
    pub fn count_results(mut self, results: InstallResults) -> Self {
        self.results = Some(results);
        self
    }

    fn count(&self, result: &str) {
        if let Some(r) = &self.results {
            r.get_or_create(&crate::metrics::ResultLabel {
                result: result.into(),
            })
            .inc();
        }
    }

    /// Readiness as the HTTP layer reads it: true while the on-disk config is verified and no
    /// change is pending.
    pub fn readiness(&self) -> tokio_watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// Why the installer is not ready while a failed pass is retried (the error names the file).
    pub fn failure(&self) -> tokio_watch::Receiver<Option<String>> {
        self.failing.subscribe()
    }

    pub fn config(&self) -> &InstallConfig {
        &self.cfg
    }

    /// Path of the CNI config file this installer last wrote.
    pub fn written_path(&self) -> Option<PathBuf> {
        self.written
            .as_ref()
            .map(|w| self.cfg.conf_dir.join(&w.name))
    }

    fn set_ready(&self, ready: bool) {
        self.ready.send_replace(ready);
    }

    fn conf_dir(&self) -> Option<HostDir> {
        HostDir::open(&self.cfg.conf_dir).ok()
    }

    fn owned_name(&self) -> Option<&str> {
        match &self.cfg.mode {
            ConfMode::Owned { filename } => Some(filename),
            _ => None,
        }
    }

    /// Copies binaries, writes the kubeconfig and, when the check fails, the CNI config.
    /// Returns the path of the CNI config in place.
    pub async fn install_all(&mut self) -> Result<PathBuf, InstallError> {
        self.installed_bins =
            match binaries::copy_binaries(&self.cfg.bin_source_dir, &self.cfg.bin_dirs) {
                Ok(bins) => bins,
                Err(e) => {
                    self.count(install_result::COPY_BINARIES_FAILURE);
                    return Err(e.into());
                }
            };
        let kc = kubeconfig::write(&self.cfg).inspect_err(|_| {
            self.count(install_result::CREATE_KUBECONFIG_FAILURE);
        })?;
        tracing::info!("wrote kubeconfig {}", kc.display());
        if let Ok(content) = std::fs::read_to_string(&kc) {
            tracing::debug!("kubeconfig:\n{}", kubeconfig::redacted(&content));
        }
        match self.check() {
            Ok(()) => tracing::info!("valid Istio config present"),
            Err(reason) => {
                tracing::info!("writing CNI config: {reason}");
                if let Err(e) = self.write_conf().await {
                    self.count(install_result::CREATE_CNI_CONFIG_FAILURE);
                    return Err(e);
                }
            }
        }
        Ok(self
            .written_path()
            .expect("a config is in place after install"))
    }

    /// Installs, then keeps the installation in place until an error a retry cannot fix (the
    /// caller stops it by dropping the future, e.g. in a `select!` with the shutdown signal, then
    /// runs [`cleanup`]). A failing pass is retried in place ([`retry`]).
    ///
    /// [`cleanup`]: Installer::cleanup
    pub async fn run(&mut self) -> Result<(), InstallError> {
        self.install_retrying().await?;
        let mut throttle = Throttle::new(THROTTLE_PERIOD);
        loop {
            let d = throttle.reserve(Instant::now());
            if d.warn {
                let path = self.written_path().unwrap_or_default();
                let hint = if path.to_string_lossy().contains("cilium") {
                    "; ensure 'cni.exclusive=false' in the Cilium configuration"
                } else {
                    ""
                };
                tracing::warn!(
                    "Configuration has been reconciled multiple times in a short period of time; another \
                     program may be rewriting {}{hint}",
                    path.display()
                );
            }
            tokio::time::sleep(d.sleep).await;
            self.sleep_watch_install().await?;
            self.install_retrying().await?;
        }
    }

    async fn install_retrying(&mut self) -> Result<PathBuf, InstallError> {
        let failing = self.failing.clone();
        retry::until_done(
            self,
            &failing,
            retry::BACKOFF,
            InstallError::is_fatal,
            |installer| Box::pin(installer.install_all()),
        )
        .await
    }

    /// Returns when something we depend on changed (or the config no longer checks out).
    async fn sleep_watch_install(&mut self) -> Result<(), InstallError> {
        let mut paths: Vec<PathBuf> = vec![
            self.cfg.conf_dir.clone(),
            self.cfg.service_account_dir.clone(),
        ];
        for dir in &self.cfg.bin_dirs {
            paths.extend(self.installed_bins.iter().map(|b| dir.join(b)));
        }
        let mut watch = FileWatch::new(paths.iter().map(PathBuf::as_path))?;
        if let Err(reason) = self.check() {
            tracing::info!("reinstalling: {reason}");
            return Ok(());
        }
        if watch.pending() {
            return Ok(());
        }
        self.set_ready(true);
        self.count(install_result::SUCCESS);
        let result = loop {
            tokio::select! {
                changed = watch.changed() => match changed {
                    Ok(paths) => {
                        tracing::info!("detected change in {paths:?}");
                        break Ok(());
                    }
                    Err(e) => break Err(e.into()),
                },
                _ = tokio::time::sleep(RECHECK) => {
                    if let Err(reason) = self.check() {
                        tracing::info!("reinstalling: {reason}");
                        break Ok(());
                    }
                }
            }
        };
        self.set_ready(false);
        result
    }

    /// Whether the installed CNI config is what we would write now; `Err` says why not.
    pub fn check(&mut self) -> Result<(), String> {
        // Changes made while no watch was active (during a throttle pause) must not be lost.
        for bin_dir in &self.cfg.bin_dirs {
            for bin in &self.installed_bins {
                let path = bin_dir.join(bin);
                if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file()) {
                    return Err(format!("{} is missing", path.display()));
                }
            }
        }
        let dir = self.conf_dir();
        let names = discovery::config_filenames(dir.as_ref()).map_err(|e| e.to_string())?;
        let dir = dir.expect("listing succeeded");
        let first = names[0].as_str();
        let Some(written) = self.written.clone() else {
            return Err("initial install".into());
        };
        let read = |name: &str| match dir.read(name) {
            Ok(Some(b)) => Ok(b),
            Ok(None) => Err(format!(
                "CNI config file {} removed",
                dir.join(name).display()
            )),
            Err(e) => Err(e.to_string()),
        };
        match self.cfg.mode.clone() {
            ConfMode::Standalone { filename } => {
                if first != filename {
                    tracing::warn!("CNI config file {filename:?} preempted by {first:?}");
                }
                let content = read(&filename)?;
                if !json_eq(&content, self.cfg.entry.standalone_file().as_bytes()) {
                    return Err("istio-cni CNI config file modified".into());
                }
            }
            ConfMode::Chained => {
                match &self.cfg.primary_name {
                    Some(configured) => {
                        let target = self
                            .resolve_named(&dir, configured)
                            .unwrap_or(configured.clone());
                        if target != written.name {
                            return Err(format!("configured primary CNI config is now {target:?}"));
                        }
                        if first != written.name {
                            tracing::warn!(
                                "CNI config file {:?} preempted by {first:?}",
                                written.name
                            );
                        }
                    }
                    None if first != written.name => {
                        return Err(format!(
                            "CNI config {first:?} now has a higher priority than {:?}; following it",
                            written.name
                        ));
                    }
                    None => {}
                }
                let contents =
                    conflist::list_contents(&read(&written.name)?).map_err(|e| e.to_string())?;
                match contents.istio_entry {
                    None => return Err("istio-cni entry removed from the CNI config".into()),
                    Some(entry) if entry != self.cfg.entry.chained_value() => {
                        return Err("istio-cni entry in the CNI config differs from ours".into());
                    }
                    Some(_) => {}
                }
            }
            ConfMode::Owned { filename } => {
                if first != filename {
                    if first <= filename.as_str() {
                        tracing::warn!(
                            "Istio owned CNI config {filename} has lower priority than {first}; the runtime \
                             will not use it (undefined behavior and potential bypass)"
                        );
                    }
                    return Err(
                        "istio owned CNI config does not exist or is not the highest priority"
                            .into(),
                    );
                }
                let primary = self
                    .owned_primary(&dir, &names)
                    .ok_or("primary CNI config not found")?;
                if written.primary.as_deref() != Some(primary.as_str()) {
                    return Err(format!("primary CNI config is now {primary:?}"));
                }
                let expected = conflist::insert_entry(&read(&primary)?, &self.cfg.entry)
                    .map_err(|e| e.to_string())?;
                if !json_eq(&read(&filename)?, expected.as_bytes()) {
                    return Err(format!(
                        "owned CNI config {filename} is out of date with {primary}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The name to use for a configured primary: itself, or the same base with the other extension.
    fn resolve_named(&self, dir: &HostDir, name: &str) -> Option<String> {
        let exists = |n: &str| dir.lstat(n).ok().flatten().is_some();
        if exists(name) {
            return Some(name.to_string());
        }
        other_extension(name).filter(|alt| exists(alt))
    }

    /// The primary the owned file is derived from: the configured one, or the best other config.
    fn owned_primary(&self, dir: &HostDir, names: &[String]) -> Option<String> {
        match &self.cfg.primary_name {
            Some(n) => self.resolve_named(dir, n),
            None => names
                .iter()
                .find(|n| Some(n.as_str()) != self.owned_name())
                .cloned(),
        }
    }

    /// Waits until the primary config exists and parses; returns its name and our edit of it
    /// (chained and owned modes). A primary that does not parse yet (still being written, or
    /// broken) is waited on, never rewritten.
    async fn wait_for_primary(&self) -> Result<(String, String), InstallError> {
        let mut last_problem = None;
        loop {
            // Watch before looking, so a file created in between still wakes us.
            let mut watch = FileWatch::new([self.cfg.conf_dir.as_path()])?;
            let problem = match self.primary_edit()? {
                Ok(found) => return Ok(found),
                Err(problem) => problem,
            };
            if last_problem.as_ref() != Some(&problem) {
                tracing::info!("waiting for the primary CNI config: {problem}");
                last_problem = Some(problem);
            }
            tokio::select! {
                r = watch.changed() => { r?; }
                _ = tokio::time::sleep(RECHECK) => {}
            }
        }
    }

    /// One look for the primary: `Ok(Ok(..))` found and edited, `Ok(Err(why))` not yet.
    #[allow(
        clippy::type_complexity,
        reason = "two levels: fatal errors and not-yet"
    )]
    fn primary_edit(&self) -> Result<Result<(String, String), String>, InstallError> {
        let Some(dir) = self.conf_dir() else {
            return Ok(Err(format!(
                "{} does not exist",
                self.cfg.conf_dir.display()
            )));
        };
        let found = match &self.cfg.primary_name {
            Some(n) => self.resolve_named(&dir, n),
            None => match discovery::config_filenames(Some(&dir)) {
                Ok(names) => self.owned_primary(&dir, &names),
                Err(DiscoveryError::HostFs(e)) => return Err(e.into()),
                Err(e) => return Ok(Err(e.to_string())),
            },
        };
        let Some(name) = found else {
            let wanted = self
                .cfg
                .primary_name
                .as_deref()
                .unwrap_or("a valid .conf/.conflist");
            return Ok(Err(format!(
                "no {wanted} in {}",
                self.cfg.conf_dir.display()
            )));
        };
        let Some(bytes) = dir.read(&name)? else {
            return Ok(Err(format!("{name} disappeared")));
        };
        match conflist::insert_entry(&bytes, &self.cfg.entry) {
            Ok(content) => Ok(Ok((name, content))),
            Err(e) => Ok(Err(self.conf_err(&name, e).to_string())),
        }
    }

    fn conf_err(&self, name: &str, source: ConfError) -> InstallError {
        InstallError::Conf {
            path: self.cfg.conf_dir.join(name),
            source,
        }
    }

    /// Writes the CNI config for the current mode and records what was written.
    async fn write_conf(&mut self) -> Result<(), InstallError> {
        let created = FileMode::Exactly(self.cfg.created_conf_mode);
        match self.cfg.mode.clone() {
            ConfMode::Standalone { filename } => {
                let dir = HostDir::open(&self.cfg.conf_dir)?;
                dir.write_atomic(
                    &filename,
                    self.cfg.entry.standalone_file().as_bytes(),
                    created,
                )?;
                self.record(&dir, filename, None);
            }
            ConfMode::Owned { filename } => {
                let (primary, content) = self.wait_for_primary().await?;
                let dir = HostDir::open(&self.cfg.conf_dir)?;
                dir.write_atomic(&filename, content.as_bytes(), created)?;
                self.record(&dir, filename, Some(primary));
            }
            ConfMode::Chained => {
                let (primary, content) = self.wait_for_primary().await?;
                let dir = HostDir::open(&self.cfg.conf_dir)?;
                let Some((_, mode)) = dir.lstat(&primary)? else {
                    return Err(HostFsError::Io {
                        op: "stat",
                        path: dir.join(&primary),
                        source: std::io::ErrorKind::NotFound.into(),
                    }
                    .into());
                };
                let target = match primary.strip_suffix(".conf") {
                    Some(base) => format!("{base}.conflist"),
                    None => primary.clone(),
                };
                dir.write_atomic(&target, content.as_bytes(), FileMode::Exactly(mode))?;
                if target != primary {
                    dir.remove(&primary)?;
                }
                self.record(&dir, target, None);
            }
        }
        Ok(())
    }

    /// Records the new file; when chained into a different primary than before, takes our entry
    /// out of the old one so only the file the runtime uses carries it.
    fn record(&mut self, dir: &HostDir, name: String, primary: Option<String>) {
        if let (ConfMode::Chained, Some(old)) = (&self.cfg.mode, &self.written)
            && old.name != name
            && let Err(e) = remove_entry_from(dir, &old.name)
        {
            tracing::warn!(
                "removing istio-cni from previous primary {}: {e}",
                dir.join(&old.name).display()
            );
        }
        tracing::info!("created CNI config {}", dir.join(&name).display());
        self.written = Some(Written { name, primary });
    }

    /// Undoes what this installer did: our entry out of the edited primary (or the file we own
    /// deleted), the kubeconfig and the `istio-cni` binary removed. Every step is attempted.
    pub fn cleanup(&mut self) -> Result<(), InstallError> {
        self.set_ready(false);
        let mut errors = Vec::new();
        if let (Some(written), Ok(dir)) = (self.written.take(), HostDir::open(&self.cfg.conf_dir)) {
            let result = match self.cfg.mode {
                ConfMode::Chained => remove_entry_from(&dir, &written.name).map(drop),
                ConfMode::Owned { .. } | ConfMode::Standalone { .. } => {
                    tracing::info!("removing {}", dir.join(&written.name).display());
                    dir.remove(&written.name)
                        .map(drop)
                        .map_err(|e| e.to_string())
                }
            };
            if let Err(e) = result {
                errors.push(e);
            }
        }
        self.remove_kubeconfig_and_binaries(&mut errors);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(InstallError::Cleanup(errors))
        }
    }

    /// Cleanup for a process that did not install (the `uninstall` command): finds our traces by
    /// content. A standalone or owned file is deleted only if it is ours; any other config only
    /// loses its istio-cni entry.
    pub fn uninstall(&mut self) -> Result<(), InstallError> {
        self.set_ready(false);
        let mut errors = Vec::new();
        if let Some(dir) = self.conf_dir()
            && let Err(e) = self.uninstall_conf(&dir)
        {
            errors.push(e);
        }
        self.remove_kubeconfig_and_binaries(&mut errors);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(InstallError::Cleanup(errors))
        }
    }

    fn uninstall_conf(&self, dir: &HostDir) -> Result<(), String> {
        let ours = |name: &str| -> bool {
            let Ok(Some(bytes)) = dir.read(name) else {
                return false;
            };
            match &self.cfg.mode {
                ConfMode::Standalone { .. } => {
                    conflist::single_type(&bytes).ok().flatten().as_deref() == Some(PLUGIN_TYPE)
                }
                _ => conflist::list_contents(&bytes).is_ok_and(|c| c.istio_entry.is_some()),
            }
        };
        match &self.cfg.mode {
            ConfMode::Standalone { filename } | ConfMode::Owned { filename } if ours(filename) => {
                tracing::info!("removing {}", dir.join(filename).display());
                dir.remove(filename).map_err(|e| e.to_string())?;
            }
            _ => {}
        }
        let mut errors = Vec::new();
        for (name, kind) in dir.list().map_err(|e| e.to_string())? {
            if kind == EntryKind::File
                && discovery::is_conf_name(&name)
                && let Err(e) = remove_entry_from(dir, &name)
            {
                errors.push(e);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    fn remove_kubeconfig_and_binaries(&self, errors: &mut Vec<String>) {
        let mut remove = |dir: &Path, name: &str| match HostDir::open(dir) {
            Ok(d) => {
                if let Err(e) = d.remove(name) {
                    errors.push(e.to_string());
                }
            }
            Err(HostFsError::OpenDir { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => errors.push(e.to_string()),
        };
        remove(&self.cfg.run_dir, kubeconfig::KUBECONFIG_FILENAME);
        for bin_dir in &self.cfg.bin_dirs {
            remove(bin_dir, PLUGIN_TYPE);
        }
    }
}

/// Takes our entry out of `name` if it has one; the file keeps its mode and every other byte.
/// A file we cannot parse is left alone. Returns whether the file changed.
fn remove_entry_from(dir: &HostDir, name: &str) -> Result<bool, String> {
    let Some(bytes) = dir.read(name).map_err(|e| e.to_string())? else {
        return Ok(false);
    };
    match conflist::remove_entry(&bytes) {
        Ok(Some(cleaned)) => {
            tracing::info!("removing istio-cni from {}", dir.join(name).display());
            dir.write_atomic(name, cleaned.as_bytes(), FileMode::KeepOr(0o600))
                .map_err(|e| e.to_string())?;
            Ok(true)
        }
        Ok(None) => Ok(false),
        Err(e) => {
            tracing::debug!(
                "leaving unparseable {} alone: {e}",
                dir.join(name).display()
            );
            Ok(false)
        }
    }
}
