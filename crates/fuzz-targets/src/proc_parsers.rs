//! Text the agent reads from other processes' `/proc/<pid>` entries (`cgroup`, `stat`, `status`,
//! `comm` + `cmdline`): a process can shape most of it, so no content may panic the parsers.
//!
//! Input layout: NUL-separated `cgroup`, `stat`, `status`, `comm`, then the rest is `cmdline`.

use cni_core::cgroup::{match_path, parse_cgroups, parse_starttime};
use dataplane::nft::host::{is_kubelet, real_uid};

pub fn run(data: &[u8]) {
    let mut parts = data.splitn(5, |b| *b == 0);
    let mut text = || std::str::from_utf8(parts.next().unwrap_or_default()).unwrap_or_default();
    let (cgroup, stat, status, comm) = (text(), text(), text(), text());
    let cmdline = parts.next().unwrap_or_default();

    if let Ok(Some(found)) = parse_cgroups(cgroup) {
        assert!(!found.container_id.is_empty());
    }
    for line in cgroup.lines() {
        let _ = match_path(line);
    }
    let _ = parse_starttime(stat);
    let _ = real_uid(status);
    let _ = is_kubelet(comm, cmdline);
}
