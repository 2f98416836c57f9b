//! What the agent does when its informers report a pod change (Istio's reconcile rules), as a pure
//! function of the old and current pod, the namespace and the configuration.

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::enroll::{CompiledSelectors, Labels, PodView, SIDECAR_STATUS_ANNOTATION};

/// The pod annotation istiod reads: a pod is captured only when it is `enabled`.
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";

/// Enrollment state recorded on the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Redirection {
    /// Not enrolled.
    Absent,
    /// Rules installed, ztunnel has not acked yet.
    Pending,
    /// Redirected and acked.
    Enabled,
}

impl Redirection {
    pub fn of(annotations: &Labels) -> Self {
        match annotations.get(REDIRECTION_ANNOTATION).map(String::as_str) {
            Some("enabled") => Redirection::Enabled,
            Some("pending") => Redirection::Pending,
            _ => Redirection::Absent,
        }
    }

    /// The annotation value, `None` meaning "remove the annotation".
    pub fn value(self) -> Option<&'static str> {
        match self {
            Redirection::Absent => None,
            Redirection::Pending => Some("pending"),
            Redirection::Enabled => Some("enabled"),
        }
    }
}

/// What reconciling needs from one version of a pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodFacts {
    pub view: PodView,
    /// Phase `Succeeded` or `Failed`.
    pub terminal: bool,
    /// `status.podIPs`, else `status.podIP`.
    pub ips: Vec<IpAddr>,
}

impl PodFacts {
    pub fn redirection(&self) -> Redirection {
        Redirection::of(&self.view.annotations)
    }
}

/// The namespace and configuration a pod is judged in.
pub struct Scope<'a> {
    pub selectors: &'a CompiledSelectors,
    pub namespace_labels: &'a Labels,
    /// The namespace is in `EXCLUDE_NAMESPACES`.
    pub excluded: bool,
}

/// Why a pod is, or is not, for the ambient mesh: the first line of an explanation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Eligibility {
    Selected,
    HostNetwork,
    SidecarPod,
    ExcludedNamespace,
    NotSelected,
}

impl Eligibility {
    pub fn is_selected(&self) -> bool {
        *self == Eligibility::Selected
    }
}

impl std::fmt::Display for Eligibility {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Eligibility::Selected => "selected by the ambient enablement selectors",
            Eligibility::HostNetwork => "uses the host network, which cannot be captured",
            Eligibility::SidecarPod => "has a sidecar (annotation sidecar.istio.io/status)",
            Eligibility::ExcludedNamespace => "its namespace is in EXCLUDE_NAMESPACES",
            Eligibility::NotSelected => {
                "no ambient enablement selector matches the pod and its namespace"
            }
        })
    }
}

/// Whether the pod should be enrolled, with the reason.
pub fn eligibility(pod: &PodView, scope: &Scope<'_>) -> Eligibility {
    if pod.host_network {
        Eligibility::HostNetwork
    } else if pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION) {
        Eligibility::SidecarPod
    } else if scope.excluded {
        Eligibility::ExcludedNamespace
    } else if scope.selectors.matches(pod, scope.namespace_labels) {
        Eligibility::Selected
    } else {
        Eligibility::NotSelected
    }
}

/// One step the agent must take for a pod update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The pod finished: remove it from the mesh with the *previous* object's IPs (a terminal status
    /// may carry none; kubernetes#125370). No in-pod rule removal: its netns is going away.
    RemoveTerminated,
    /// The pod's IPs changed while enrolled: the new ones go into the host probe set, the old ones out.
    SyncProbeIps,
    /// No longer selected: remove the rules from the running pod, tell ztunnel, clear the annotation.
    Remove,
    /// Selected and not enrolled (or only pending): enroll it with its current IPs.
    Add,
}

/// The actions for an update event, in order. A pod without IPs is left to its CNI ADD.
pub fn on_update(old: &PodFacts, current: &PodFacts, scope: &Scope<'_>) -> Vec<Action> {
    let state = current.redirection();
    let enrolled = state == Redirection::Enabled;
    let partial = state == Redirection::Pending;
    let should = eligibility(&current.view, scope).is_selected();

    if current.terminal {
        return if enrolled || partial {
            vec![Action::RemoveTerminated]
        } else {
            vec![]
        };
    }
    let mut actions = Vec::new();
    if enrolled && should && !current.ips.is_empty() && ip_set(&current.ips) != ip_set(&old.ips) {
        actions.push(Action::SyncProbeIps);
    }
    let change_needed = enrolled != should || partial;
    if !change_needed {
        return actions;
    }
    if !should {
        actions.push(Action::Remove);
    } else if !current.ips.is_empty() {
        actions.push(Action::Add);
    }
    actions
}

/// Whether a deleted pod must be removed from the mesh: it was enrolled (or pending), or it is
/// selected (its CNI ADD may have enrolled it without the annotation reaching us).
pub fn on_delete(pod: &PodFacts, scope: &Scope<'_>) -> bool {
    pod.redirection() != Redirection::Absent
        || scope.selectors.matches(&pod.view, scope.namespace_labels)
}

fn ip_set(ips: &[IpAddr]) -> BTreeSet<IpAddr> {
    ips.iter().copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enroll::{DATAPLANE_MODE_LABEL, default_selectors};

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn pod(
        labels_: &[(&str, &str)],
        annotations: &[(&str, &str)],
        ips: &[&str],
        terminal: bool,
    ) -> PodFacts {
        PodFacts {
            view: PodView {
                labels: labels(labels_),
                annotations: labels(annotations),
                host_network: false,
            },
            terminal,
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        }
    }

    const AMBIENT: &[(&str, &str)] = &[(DATAPLANE_MODE_LABEL, "ambient")];
    const ENABLED: &[(&str, &str)] = &[(REDIRECTION_ANNOTATION, "enabled")];
    const PENDING: &[(&str, &str)] = &[(REDIRECTION_ANNOTATION, "pending")];

    struct Case {
        name: &'static str,
        ns: &'static [(&'static str, &'static str)],
        excluded: bool,
        old: PodFacts,
        cur: PodFacts,
        want: Vec<Action>,
    }

    #[test]
    fn update_rules() {
        let cases = vec![
            Case {
                name: "running pod in a newly labelled namespace is added",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], &[], &["10.0.0.5"], false),
                cur: pod(&[], &[], &["10.0.0.5"], false),
                want: vec![Action::Add],
            },
            Case {
                name: "pod without IPs is left to its CNI ADD",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], &[], &[], false),
                cur: pod(&[], &[], &[], false),
                want: vec![],
            },
            Case {
                name: "enrolled and still selected: nothing",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], ENABLED, &["10.0.0.5"], false),
                cur: pod(&[], ENABLED, &["10.0.0.5"], false),
                want: vec![],
            },
            Case {
                name: "pending is retried",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], PENDING, &["10.0.0.5"], false),
                cur: pod(&[], PENDING, &["10.0.0.5"], false),
                want: vec![Action::Add],
            },
            Case {
                name: "namespace unlabelled: removed",
                ns: &[],
                excluded: false,
                old: pod(&[], ENABLED, &["10.0.0.5"], false),
                cur: pod(&[], ENABLED, &["10.0.0.5"], false),
                want: vec![Action::Remove],
            },
            Case {
                name: "pod labelled none: removed",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], ENABLED, &["10.0.0.5"], false),
                cur: pod(
                    &[(DATAPLANE_MODE_LABEL, "none")],
                    ENABLED,
                    &["10.0.0.5"],
                    false,
                ),
                want: vec![Action::Remove],
            },
            Case {
                name: "excluded namespace: enrolled pod removed",
                ns: AMBIENT,
                excluded: true,
                old: pod(&[], ENABLED, &["10.0.0.5"], false),
                cur: pod(&[], ENABLED, &["10.0.0.5"], false),
                want: vec![Action::Remove],
            },
            Case {
                name: "excluded namespace: labelled pod not enrolled",
                ns: &[],
                excluded: true,
                old: pod(AMBIENT, &[], &["10.0.0.5"], false),
                cur: pod(AMBIENT, &[], &["10.0.0.5"], false),
                want: vec![],
            },
            Case {
                name: "terminated enrolled job pod: removed with the old IPs",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], ENABLED, &["10.0.0.5"], false),
                cur: pod(&[], ENABLED, &[], true),
                want: vec![Action::RemoveTerminated],
            },
            Case {
                name: "terminated pod never enrolled: nothing",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], &[], &["10.0.0.5"], false),
                cur: pod(&[], &[], &[], true),
                want: vec![],
            },
            Case {
                name: "enrolled pod whose IP changed: probe set refreshed only",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], ENABLED, &[], false),
                cur: pod(&[], ENABLED, &["10.0.0.5"], false),
                want: vec![Action::SyncProbeIps],
            },
            Case {
                name: "same IPs in another order: no refresh",
                ns: AMBIENT,
                excluded: false,
                old: pod(&[], ENABLED, &["fd00::5", "10.0.0.5"], false),
                cur: pod(&[], ENABLED, &["10.0.0.5", "fd00::5"], false),
                want: vec![],
            },
            Case {
                name: "sidecar pod is never ambient",
                ns: AMBIENT,
                excluded: false,
                old: pod(
                    &[],
                    &[(SIDECAR_STATUS_ANNOTATION, "{}")],
                    &["10.0.0.5"],
                    false,
                ),
                cur: pod(
                    &[],
                    &[(SIDECAR_STATUS_ANNOTATION, "{}")],
                    &["10.0.0.5"],
                    false,
                ),
                want: vec![],
            },
        ];
        let selectors = CompiledSelectors::compile(&default_selectors()).unwrap();
        for c in cases {
            let ns = labels(c.ns);
            let scope = Scope {
                selectors: &selectors,
                namespace_labels: &ns,
                excluded: c.excluded,
            };
            assert_eq!(on_update(&c.old, &c.cur, &scope), c.want, "{}", c.name);
        }
    }

    #[test]
    fn delete_rules() {
        let selectors = CompiledSelectors::compile(&default_selectors()).unwrap();
        let none = Labels::new();
        let ambient = labels(AMBIENT);
        let scope = |ns| Scope {
            selectors: &selectors,
            namespace_labels: ns,
            excluded: false,
        };
        assert!(on_delete(&pod(&[], ENABLED, &[], false), &scope(&none)));
        assert!(
            on_delete(&pod(&[], &[], &[], false), &scope(&ambient)),
            "selected but not yet annotated"
        );
        assert!(!on_delete(&pod(&[], &[], &[], false), &scope(&none)));
    }

    #[test]
    fn eligibility_reasons() {
        let selectors = CompiledSelectors::compile(&default_selectors()).unwrap();
        let ambient = labels(AMBIENT);
        let scope = Scope {
            selectors: &selectors,
            namespace_labels: &ambient,
            excluded: false,
        };
        let mut p = pod(&[], &[], &[], false).view;
        assert_eq!(eligibility(&p, &scope), Eligibility::Selected);
        p.host_network = true;
        assert_eq!(eligibility(&p, &scope), Eligibility::HostNetwork);
        let excluded = Scope {
            excluded: true,
            ..scope
        };
        assert_eq!(
            eligibility(&pod(&[], &[], &[], false).view, &excluded),
            Eligibility::ExcludedNamespace
        );
    }
}
