//! The broken-pod test (Istio's `matchesFilter`), kept pure so Istio's cases run as a table.
//!
//! A pod is broken when its validation init container last died with the configured exit code
//! (126: "traffic is not redirected") and message, and is not currently completed: a container
//! that has since succeeded proves the redirection is in place, whatever happened before.

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};

use super::config::BrokenPodFilter;

fn terminated_matches(filter: &BrokenPodFilter, t: &ContainerStateTerminated) -> bool {
    let wanted_message = filter.termination_message.trim();
    let message_ok = wanted_message.is_empty()
        || wanted_message == t.message.as_deref().unwrap_or_default().trim();
    let code_ok = filter.exit_code == 0 || filter.exit_code == t.exit_code;
    message_ok && code_ok
}

/// Whether `pod` has the sidecar-race symptom described by `filter`.
pub fn is_broken(pod: &Pod, filter: &BrokenPodFilter) -> bool {
    if !is_candidate(pod, filter) {
        return false;
    }
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_deref())
        .unwrap_or_default();
    statuses
        .iter()
        .filter(|c| filter.init_container_name.is_empty() || c.name == filter.init_container_name)
        .filter(|c| {
            let current = c.state.as_ref().and_then(|s| s.terminated.as_ref());
            !current.is_some_and(|t| t.reason.as_deref() == Some("Completed") || t.exit_code == 0)
        })
        .filter_map(|c| c.last_state.as_ref().and_then(|s| s.terminated.as_ref()))
        .any(|t| terminated_matches(filter, t))
}

/// Whether `pod` can be broken at all: it has the sidecar annotation, or no annotation is asked
/// for. Most pods of an ambient node have none, and the repair watch does not keep them.
pub fn is_candidate(pod: &Pod, filter: &BrokenPodFilter) -> bool {
    filter.sidecar_annotation.is_empty()
        || pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(&filter.sidecar_annotation))
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn pod(annotated: bool, init_status: Value) -> Pod {
        let annotations = if annotated {
            json!({"sidecar.istio.io/status": "something"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "metadata": {"name": "p", "annotations": annotations},
            "spec": {
                "initContainers": [{"name": "istio-validation"}],
                "containers": [{"name": "payload-container"}]
            },
            "status": {
                "initContainerStatuses": [init_status],
                "containerStatuses": [{
                    "name": "payload-container", "ready": false, "restartCount": 0, "image": "",
                    "imageID": "", "state": {"waiting": {"reason": "PodInitializing"}}
                }]
            }
        }))
        .unwrap()
    }

    fn status(state: Value, last: Value) -> Value {
        json!({
            "name": "istio-validation", "ready": false, "restartCount": 3, "image": "",
            "imageID": "", "state": state, "lastState": last
        })
    }

    fn died(code: i32, message: &str) -> Value {
        json!({"terminated": {"exitCode": code, "reason": "Error", "message": message}})
    }

    fn completed() -> Value {
        json!({"terminated": {"exitCode": 0, "reason": "Completed"}})
    }

    fn crash_loop() -> Value {
        json!({"waiting": {"reason": "CrashLoopBackOff", "message": "Back-off 5m0s restarting failed"}})
    }

    fn exit_code_filter(code: i32) -> BrokenPodFilter {
        BrokenPodFilter {
            exit_code: code,
            ..BrokenPodFilter::default()
        }
    }

    fn message_filter(message: &str) -> BrokenPodFilter {
        BrokenPodFilter {
            termination_message: message.into(),
            exit_code: 0,
            ..BrokenPodFilter::default()
        }
    }

    /// A crash-looping validation container whose last death had `message` and `code`.
    fn detect_pod(message: &str, code: i32) -> Pod {
        pod(true, status(crash_loop(), died(code, message)))
    }

    #[test]
    fn matches_filter_cases_from_istio() {
        let reason = "Died for some reason";
        let cases: Vec<(&str, BrokenPodFilter, Pod, bool)> = vec![
            (
                "working pod",
                exit_code_filter(126),
                pod(true, status(completed(), json!({}))),
                false,
            ),
            (
                "working pod that previously died",
                exit_code_filter(126),
                pod(true, status(completed(), died(126, reason))),
                false,
            ),
            (
                "broken pod, waiting",
                exit_code_filter(126),
                pod(true, status(crash_loop(), died(126, reason))),
                true,
            ),
            (
                "broken pod, terminating",
                exit_code_filter(126),
                pod(true, status(died(126, reason), died(126, reason))),
                true,
            ),
            (
                "broken pod, wrong exit code",
                exit_code_filter(55),
                pod(true, status(crash_loop(), died(126, reason))),
                false,
            ),
            (
                "broken pod without the sidecar annotation",
                exit_code_filter(126),
                pod(false, status(crash_loop(), died(126, reason))),
                false,
            ),
            (
                "termination message mismatch",
                message_filter("Termination Message"),
                detect_pod("This Does Not Match", 0),
                false,
            ),
            (
                "termination message match",
                message_filter("Termination Message"),
                detect_pod("Termination Message", 0),
                true,
            ),
            (
                "termination message match, spaces trimmed on both sides",
                message_filter("            Termination Message"),
                detect_pod("Termination Message              ", 0),
                true,
            ),
            (
                "exit code mismatch",
                exit_code_filter(126),
                detect_pod("", 121),
                false,
            ),
            (
                "exit code match",
                exit_code_filter(126),
                detect_pod("", 126),
                true,
            ),
            (
                "badly formatted pod",
                exit_code_filter(126),
                pod(
                    true,
                    json!({"name": "", "ready": false, "restartCount": 0, "image": "", "imageID": ""}),
                ),
                false,
            ),
        ];
        for (name, filter, pod, want) in cases {
            assert_eq!(is_broken(&pod, &filter), want, "{name}");
        }
    }

    #[test]
    fn empty_names_widen_the_filter() {
        let mut other = status(crash_loop(), died(126, ""));
        other["name"] = json!("some-other-init");
        let p = pod(false, other);
        assert!(!is_broken(&p, &exit_code_filter(126)));
        let any = BrokenPodFilter {
            sidecar_annotation: String::new(),
            init_container_name: String::new(),
            ..exit_code_filter(126)
        };
        assert!(is_broken(&p, &any));
    }

    #[test]
    fn pods_without_status_are_not_broken() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "annotations": {"sidecar.istio.io/status": "{}"}}
        }))
        .unwrap();
        assert!(!is_broken(&p, &BrokenPodFilter::default()));
    }
}
