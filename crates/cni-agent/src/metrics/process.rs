//! Prometheus' standard `process_*` metrics (the names Go's process collector exports, which
//! Istio's dashboards chart), read from `/proc/self` at each scrape so they are never stale.

use std::path::{Path, PathBuf};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// One reading of a process's resource use.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub start_time_seconds: f64,
    pub open_fds: u64,
    /// Soft `RLIMIT_NOFILE`; `None` when unlimited.
    pub max_fds: Option<u64>,
}

/// Fields of `/proc/<pid>/stat` the metrics need, in the kernel's units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatFields {
    /// utime + stime, clock ticks.
    pub cpu_ticks: u64,
    /// Start time after boot, clock ticks.
    pub start_ticks: u64,
    pub vsize_bytes: u64,
    pub rss_pages: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) may hold spaces and parentheses, so
/// fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<StatFields> {
    let rest = &text[text.rfind(')')? + 1..];
    // After the name: state is field 3, so field N is at index N - 3.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(StatFields {
        cpu_ticks: num(14)? + num(15)?,
        start_ticks: num(22)?,
        vsize_bytes: num(23)?,
        rss_pages: num(24)?,
    })
}

/// Boot time (`btime`, seconds since the epoch) from `/proc/stat`.
pub fn parse_btime(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// Soft limit of "Max open files" in `/proc/<pid>/limits`; `None` for unlimited or absent.
pub fn parse_max_open_files(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Reads the process whose `/proc` directory is `dir`; `proc_stat` is the system's `/proc/stat`.
pub fn read(dir: &Path, proc_stat: &Path) -> std::io::Result<ProcessStats> {
    let bad = |what: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unreadable {what} under {}", dir.display()),
        )
    };
    let stat =
        parse_stat(&std::fs::read_to_string(dir.join("stat"))?).ok_or_else(|| bad("stat"))?;
    let btime = parse_btime(&std::fs::read_to_string(proc_stat)?).ok_or_else(|| bad("btime"))?;
    let open_fds = std::fs::read_dir(dir.join("fd"))?.count() as u64;
    let max_fds = std::fs::read_to_string(dir.join("limits"))
        .ok()
        .and_then(|l| parse_max_open_files(&l));
    let ticks = clock_ticks();
    let page = page_size();
    Ok(ProcessStats {
        cpu_seconds: stat.cpu_ticks as f64 / ticks,
        resident_bytes: stat.rss_pages * page,
        virtual_bytes: stat.vsize_bytes,
        start_time_seconds: btime as f64 + stat.start_ticks as f64 / ticks,
        open_fds,
        max_fds,
    })
}

fn clock_ticks() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)
        .unwrap_or(100) as f64
}

fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .filter(|p| *p > 0)
        .unwrap_or(4096) as u64
}

/// Collector reading a process's `/proc` directory on every scrape.
#[derive(Debug)]
pub struct ProcessCollector {
    dir: PathBuf,
    proc_stat: PathBuf,
}

impl ProcessCollector {
    /// This process.
    pub fn current() -> Self {
        ProcessCollector {
            dir: "/proc/self".into(),
            proc_stat: "/proc/stat".into(),
        }
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        // A /proc read failure leaves these metrics out of one scrape rather than failing it.
        let Ok(s) = read(&self.dir, &self.proc_stat) else {
            return Ok(());
        };
        let counter = ConstCounter::new(s.cpu_seconds);
        counter.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            counter.metric_type(),
        )?)?;
        let mut gauges: Vec<(&str, &str, f64)> = vec![
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_bytes as f64,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_bytes as f64,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                s.start_time_seconds,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds as f64,
            ),
        ];
        if let Some(max) = s.max_fds {
            gauges.push((
                "process_max_fds",
                "Maximum number of open file descriptors",
                max as f64,
            ));
        }
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        // A command name with spaces and a ')' must not shift the fields.
        let line = "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 3 0 12345 \
                    104857600 2560 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(StatFields {
                cpu_ticks: 300,
                start_ticks: 12345,
                vsize_bytes: 104_857_600,
                rss_pages: 2560,
            })
        );
        assert_eq!(parse_stat("4242 (truncated"), None);
        assert_eq!(parse_stat("1 (x) S 1 2"), None);
    }

    #[test]
    fn btime_and_fd_limit() {
        assert_eq!(
            parse_btime("cpu  1 2 3\nbtime 1764600000\nprocesses 9\n"),
            Some(1_764_600_000)
        );
        assert_eq!(parse_btime("cpu 1\n"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             63602                63602                processes \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_open_files(limits), Some(1024));
        assert_eq!(
            parse_max_open_files(
                "Max open files            unlimited            unlimited            files\n"
            ),
            None
        );
    }

    #[test]
    fn reads_this_process() {
        let before = read(Path::new("/proc/self"), Path::new("/proc/stat")).unwrap();
        // Open files are counted on children whose tables nobody else touches (this process's
        // changes as other test threads open and close theirs). Both inherit whatever the test
        // harness left open, so they differ by exactly the 16 the second one opens first.
        let open_fds_of = |script: &str| {
            let mut child = std::process::Command::new("bash")
                .args(["-c", script])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            // The child says when it has opened all it opens (`exec sleep` keeps its table).
            let mut ready = [0u8; 1];
            std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut ready).unwrap();
            let stats = read(
                Path::new(&format!("/proc/{}", child.id())),
                Path::new("/proc/stat"),
            );
            child.kill().unwrap();
            child.wait().unwrap();
            stats.unwrap().open_fds
        };
        let plain = open_fds_of("echo; exec sleep 60");
        let more = open_fds_of(
            "for fd in {100..115}; do eval \"exec $fd</dev/null\"; done; echo; exec sleep 60",
        );
        assert_eq!(more, plain + 16);
        // Burning CPU must show up as CPU time (on a loaded machine it takes longer than it spins).
        let spin = std::time::Instant::now();
        let later = loop {
            for i in 0..100_000u64 {
                std::hint::black_box(i);
            }
            let now = read(Path::new("/proc/self"), Path::new("/proc/stat")).unwrap();
            if now.cpu_seconds > before.cpu_seconds || spin.elapsed().as_secs() > 20 {
                break now;
            }
        };
        assert!(
            later.cpu_seconds > before.cpu_seconds,
            "{before:?} {later:?}"
        );
        assert!(before.resident_bytes > 1 << 20, "{before:?}");
        assert!(before.virtual_bytes >= before.resident_bytes, "{before:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            before.start_time_seconds <= now + 1.0 && before.start_time_seconds > now - 86_400.0,
            "{before:?}"
        );
        assert!(before.max_fds.is_some_and(|m| m >= before.open_fds));
    }
}
