//! Our log lines against Istio's own logger: `tools/istio/log-golden` writes a fixed set of
//! records through `istio.io/istio/pkg/log` (configured from Istio's flags, with install-cni's
//! scopes and its log.sock server for the plugin's records); [`write_ours`] writes the same
//! records through [`IstioLog`]. Each record is compared field by field: level, scope, caller
//! (its shape: the files differ), message, labels (with their JSON types), stack (present or
//! not), and the time of the plugin's records (the plugin's own). Other times are the clock's.
//!
//! Also here: what a new user sees first from `install-cni install --once` (the configuration as
//! readable labels, an error's cause said once).

use std::path::{Path, PathBuf};
use std::process::Command;

use cni_agent::cli::Cli;
use cni_agent::config::parse_from;
use cni_agent::logging::{ISTIO_SCOPES, IstioLog};
use serde_json::Value;
use tracing_subscriber::layer::SubscriberExt;

const BATCH: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/testdata/plugin-log-batch.json"
);

/// The golden program, built (once, cached) from the pinned Istio by `tools/istio/build.sh`.
fn golden_bin() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/istio/build.sh");
    let out = Command::new(&script).arg("log-golden").output().unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    Path::new(
        stdout
            .lines()
            .last()
            .expect("build.sh prints the cache dir"),
    )
    .join("log-golden")
}

fn golden(bin: &Path, flags: &[&str]) -> String {
    let out = Command::new(bin).args(flags).arg(BATCH).output().unwrap();
    assert!(
        out.status.success(),
        "log-golden {flags:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn logger(flags: &[&str]) -> Result<IstioLog, String> {
    let argv = ["install-cni"].into_iter().chain(flags.iter().copied());
    let cli: Cli = parse_from(argv, &std::collections::HashMap::<String, String>::new())
        .map_err(|e| e.to_string())?;
    IstioLog::from_args(&cli.log).map_err(|e| e.to_string())
}

/// The golden's records, logged as the agent logs them: its own records under the agent's
/// crate (scope `cni-agent`), a dependency's (`default`), and the plugin batch through log.sock.
fn write_ours(flags: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.log");
    let target = format!("--log_target={}", file.display());
    let flags: Vec<&str> = flags.iter().copied().chain([target.as_str()]).collect();
    let subscriber = tracing_subscriber::registry().with(logger(&flags).unwrap());
    tracing::subscriber::with_default(subscriber, || {
        tracing::info!(target: "cni_agent::install", "installer configuration");
        tracing::debug!(target: "cni_agent::install", pod = "default/web-0", "checking pod");
        tracing::warn!(target: "cni_agent::install", pod = "default/web-0", attempt = 2,
            meshed = false, "pod not meshed yet");
        tracing::error!(target: "cni_agent::install",
            "copying binaries: reading /opt/cni/bin: No such file or directory (os error 2)");
        tracing::info!(target: "kube_client", component = "kube", "default scope record");
        tracing::debug!(target: "kube_client", "default scope debug");
        let batch = std::fs::read(BATCH).unwrap();
        cni_agent::logsock::emit(&cni_agent::logsock::parse_batch(&batch));
        tracing::info!(target: "cni_agent::install", "done");
    });
    std::fs::read_to_string(&file).unwrap()
}

/// One record with what is comparable across the two loggers.
#[derive(Debug, PartialEq)]
struct Rec {
    level: String,
    scope: Option<String>,
    /// `dir/file:line`, checked for shape, then kept as whether it is there.
    caller: bool,
    msg: String,
    labels: Vec<(String, Value)>,
    stack: bool,
    /// The plugin's records keep the plugin's time; other times are the clock's.
    plugin_time: Option<String>,
}

/// What both agents log, at debug, for a plugin record they cannot read.
const BAD_RECORD: &str = "Failed to unmarshal CNI plugin log entry: ";

fn caller_shape(c: &str) -> bool {
    let (file, line) = c.rsplit_once(':').unwrap_or(("", ""));
    file.split('/').count() == 2 && !line.is_empty() && line.chars().all(|d| d.is_ascii_digit())
}

fn is_time(s: &str) -> bool {
    s.len() == 27 && s.as_bytes()[10] == b'T' && s.ends_with('Z')
}

fn rec(
    level: &str,
    scope: Option<&str>,
    caller: Option<&str>,
    time: &str,
    msg: &str,
    mut labels: Vec<(String, Value)>,
    stack: bool,
) -> Rec {
    assert!(is_time(time), "time {time:?}");
    if let Some(c) = caller {
        assert!(caller_shape(c), "caller {c:?}");
    }
    // Istio re-emits the plugin's labels in Go map order (random); ours are in key order.
    labels.sort_by(|a, b| a.0.cmp(&b.0));
    // The parser's own words differ (Go's encoding/json, serde_json).
    let msg = match msg.split_once(BAD_RECORD) {
        Some(_) => BAD_RECORD,
        None => msg,
    };
    Rec {
        level: level.into(),
        scope: scope.map(Into::into),
        caller: caller.is_some(),
        msg: msg.into(),
        labels,
        stack,
        plugin_time: (scope == Some("cni-plugin")).then(|| time.into()),
    }
}

/// Text lines: `time<TAB>level<TAB>[scope<TAB>][caller<TAB>]msg[<TAB>k=v ...]`, the stack on the
/// lines after (they do not start with a time).
fn parse_text(out: &str) -> Vec<Rec> {
    let mut recs: Vec<Rec> = Vec::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        if !is_time(f[0]) {
            recs.last_mut().expect("a stack follows a record").stack = true;
            continue;
        }
        let mut i = 2;
        let scope = ISTIO_SCOPES.contains(&f[i]).then(|| {
            i += 1;
            f[i - 1]
        });
        let caller = caller_shape(f[i]).then(|| {
            i += 1;
            f[i - 1]
        });
        let labels = f
            .get(i + 1)
            .map(|l| {
                let mut labels: Vec<(String, Value)> = Vec::new();
                // A space inside a value continues it.
                for piece in l.split(' ') {
                    match piece.split_once('=') {
                        Some((k, v)) => labels.push((k.into(), v.into())),
                        None => {
                            let (_, v) = labels.last_mut().expect("k=v first");
                            *v = format!("{} {piece}", v.as_str().unwrap()).into();
                        }
                    }
                }
                labels
            })
            .unwrap_or_default();
        recs.push(rec(f[1], scope, caller, f[0], f[i], labels, false));
    }
    recs
}

fn parse_json(out: &str) -> Vec<Rec> {
    out.lines()
        .map(|line| {
            let Value::Object(mut m) = serde_json::from_str(line).unwrap() else {
                panic!("not an object: {line}");
            };
            let mut take = |k: &str| m.remove(k).map(|v| v.as_str().unwrap().to_string());
            let (level, time, scope) = (take("level"), take("time"), take("scope"));
            let (caller, msg, stack) = (take("caller"), take("msg"), take("stack"));
            rec(
                &level.unwrap(),
                scope.as_deref(),
                caller.as_deref(),
                &time.unwrap(),
                &msg.unwrap(),
                m.into_iter().collect(),
                stack.is_some(),
            )
        })
        .collect()
}

fn parse(flags: &[&str], out: &str) -> Vec<Rec> {
    if flags.contains(&"--log_as_json") {
        parse_json(out)
    } else {
        parse_text(out)
    }
}

/// Istio's log.sock server logs its own start at debug; ours logs its listeners elsewhere.
/// Record by record, so a failure names the first record that differs.
fn assert_same(got: &[Rec], want: &[Rec], flags: &[&str]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "{flags:?}: record {i}");
    }
    assert_eq!(got.len(), want.len(), "{flags:?}: {got:#?}\n{want:#?}");
}

fn without_istio_socket_setup(recs: Vec<Rec>) -> Vec<Rec> {
    recs.into_iter()
        .filter(|r| r.msg != "starting UDS server for CNI plugin logs")
        .collect()
}

#[test]
fn records_match_istios_logger() {
    dataplane::enter_test_group!();
    let bin = golden_bin();
    let cases: &[&[&str]] = &[
        &[],
        &["--log_as_json"],
        // An unscoped level is the `default` scope's only.
        &["--log_output_level=warn"],
        // Istio's log.sock server filters the plugin's records by the cni-agent level (see
        // the_plugin_scope_has_its_own_level): the two move together here.
        &[
            "--log_output_level=cni-agent:debug,cni-plugin:debug,default:debug",
            "--log_caller=cni-agent",
        ],
        &[
            "--log_as_json",
            "--log_output_level=all:debug",
            "--log_caller=all",
            "--log_stacktrace_level=cni-agent:error,default:error",
        ],
        &["--log_stacktrace_level=default:info"],
    ];
    for flags in cases {
        let want = without_istio_socket_setup(parse(flags, &golden(&bin, flags)));
        let got = parse(flags, &write_ours(flags));
        assert!(want.len() > 1, "{flags:?}: {want:?}");
        assert_same(&got, &want, flags);
    }
}

/// `--log_output_level=cni-plugin:debug` shows the plugin's debug records. Istio's agent drops
/// them: its log.sock server gives the `cni-plugin` scope the `cni-agent` level
/// (`NewUDSLogger(log.GetOutputLevel())` in cni/pkg/cmd/root.go), so the flag only reaches the
/// plugin's own stderr. Everything else is as Istio writes it.
#[test]
fn the_plugin_scope_has_its_own_level() {
    dataplane::enter_test_group!();
    let bin = golden_bin();
    let flags = ["--log_output_level=cni-plugin:debug"];
    let want = without_istio_socket_setup(parse(&flags, &golden(&bin, &flags)));
    let (extra, got): (Vec<Rec>, Vec<Rec>) = parse(&flags, &write_ours(&flags))
        .into_iter()
        .partition(|r| r.scope.as_deref() == Some("cni-plugin") && r.level == "debug");
    assert_same(&got, &want, &flags);
    assert_eq!(
        extra.iter().map(|r| r.msg.as_str()).collect::<Vec<_>>(),
        ["plugin debug"]
    );
    assert!(!want.iter().any(|r| r.msg == "plugin debug"));
}

#[test]
fn scopes_are_install_cnis() {
    dataplane::enter_test_group!();
    let out = Command::new(golden_bin()).arg("scopes").output().unwrap();
    let theirs: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(theirs, ISTIO_SCOPES);
}

/// Istio skips an unknown scope and, for an unknown level, logs the error and runs on with the
/// levels it had; we refuse both at start, naming what is known.
#[test]
fn unknown_scopes_and_levels_are_refused() {
    dataplane::enter_test_group!();
    let bin = golden_bin();
    let default = without_istio_socket_setup(parse(&[], &golden(&bin, &[])));
    let typo = ["--log_output_level=cni-agnet:debug"];
    assert_eq!(
        without_istio_socket_setup(parse(&typo, &golden(&bin, &typo))),
        default
    );
    let loud = golden(&bin, &["--log_output_level=cni-agent:loud"]);
    assert!(
        loud.lines()
            .next()
            .unwrap()
            .ends_with("Failed to configure log invalid output level 'loud'"),
        "{loud}"
    );

    let known = ISTIO_SCOPES.join(", ");
    for (flag, reason) in [
        (
            "--log_output_level=cni-agnet:debug",
            format!("invalid --log_output_level: unknown scope \"cni-agnet\" (scopes: all, {known})"),
        ),
        (
            "--log_output_level=cni-agent:loud",
            "invalid --log_output_level: unknown level \"loud\" (levels: debug, info, warn, error, fatal, none)".into(),
        ),
        (
            "--log_stacktrace_level=nope:error",
            format!("invalid --log_stacktrace_level: unknown scope \"nope\" (scopes: all, {known})"),
        ),
        (
            "--log_caller=cni_agent",
            format!("invalid --log_caller: unknown scope \"cni_agent\" (scopes: all, {known})"),
        ),
    ] {
        assert_eq!(logger(&[flag]).err().as_deref(), Some(reason.as_str()), "{flag}");
    }
}

/// A fresh node whose image has no plugin binaries: the installer's first lines.
#[test]
fn install_once_says_its_configuration_and_an_errors_cause_once() {
    dataplane::enter_test_group!();
    let root = tempfile::tempdir().unwrap();
    let p = |n: &str| root.path().join(n);
    for d in ["net.d", "bin", "sa"] {
        std::fs::create_dir_all(p(d)).unwrap();
    }
    std::fs::write(p("sa/token"), "t").unwrap();
    std::fs::write(p("sa/ca.crt"), "c").unwrap();
    let missing = p("image-bin");
    let out = Command::new(env!("CARGO_BIN_EXE_install-cni"))
        .env_clear()
        .env("MOUNTED_CNI_NET_DIR", p("net.d"))
        .env("CNI_BIN_DIR", p("bin"))
        .env("CNI_BIN_SOURCE_DIR", &missing)
        .env("CNI_AGENT_RUN_DIR", p("run"))
        .env("SERVICE_ACCOUNT_DIR", p("sa"))
        .env("KUBERNETES_SERVICE_HOST", "10.96.0.1")
        .env("KUBERNETES_SERVICE_PORT", "443")
        .args(["install", "--once"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    let recs = parse_text(&stderr);
    let config = recs
        .iter()
        .find(|r| r.msg == "installer configuration")
        .unwrap_or_else(|| panic!("{stderr}"));
    let label = |k: &str| {
        config
            .labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str().unwrap().to_string())
    };
    assert_eq!(label("mode").as_deref(), Some("chained"), "{stderr}");
    assert_eq!(label("bin_source_dir"), Some(missing.display().to_string()));
    assert_eq!(
        label("kube_service").as_deref(),
        Some("https://10.96.0.1:443")
    );
    assert!(!stderr.contains("InstallConfig {"), "{stderr}");
    let errors: Vec<&Rec> = recs.iter().filter(|r| r.level == "error").collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert_eq!(errors[0].scope.as_deref(), Some("cni-agent"));
    assert_eq!(
        errors[0].msg,
        format!(
            "copying binaries: reading {}: No such file or directory (os error 2)",
            missing.display()
        )
    );
}
