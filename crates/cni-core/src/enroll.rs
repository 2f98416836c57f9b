//! Which pods belong in the ambient mesh: Istio's enablement selectors (`AMBIENT_ENABLEMENT_SELECTOR`,
//! written into the plugin config as `enablement_selectors`) evaluated against a pod and its
//! namespace's labels. The plugin (pod JSON from the API server) and the agent (informer objects)
//! both reduce a pod to a [`PodView`] and ask the same [`CompiledSelectors`].

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The label that opts pods and namespaces in (`ambient`) or out (`none`).
pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
/// Set by the sidecar injector; a pod with it is a sidecar pod and never ambient.
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";

pub type Labels = BTreeMap<String, String>;

/// A Kubernetes `LabelSelector` as JSON carries it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "crate::cni::nullable"
    )]
    pub match_labels: Labels,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "crate::cni::nullable"
    )]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelSelectorRequirement {
    pub key: String,
    pub operator: String,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "crate::cni::nullable"
    )]
    pub values: Vec<String>,
}

/// One entry of `enablement_selectors`: the pod matches when both selectors match.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnablementSelector {
    #[serde(default, deserialize_with = "crate::cni::nullable")]
    pub pod_selector: LabelSelector,
    #[serde(default, deserialize_with = "crate::cni::nullable")]
    pub namespace_selector: LabelSelector,
}

/// Istio's default `AMBIENT_ENABLEMENT_SELECTOR` (Helm values): a pod labelled ambient, or any pod
/// not labelled `none` in a namespace labelled ambient.
pub fn default_selectors() -> Vec<EnablementSelector> {
    let ambient: Labels = [(DATAPLANE_MODE_LABEL.to_owned(), "ambient".to_owned())].into();
    vec![
        EnablementSelector {
            pod_selector: LabelSelector {
                match_labels: ambient.clone(),
                ..Default::default()
            },
            namespace_selector: LabelSelector::default(),
        },
        EnablementSelector {
            pod_selector: LabelSelector {
                match_labels: Labels::new(),
                match_expressions: vec![LabelSelectorRequirement {
                    key: DATAPLANE_MODE_LABEL.to_owned(),
                    operator: "NotIn".to_owned(),
                    values: vec!["none".to_owned()],
                }],
            },
            namespace_selector: LabelSelector {
                match_labels: ambient,
                ..Default::default()
            },
        },
    ]
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("{0:?} is not a valid label selector operator")]
    Operator(String),
    #[error("label selector key must not be empty")]
    EmptyKey,
    #[error("label selector on {key:?}: values set can't be empty for operator {operator}")]
    ValuesRequired { key: String, operator: String },
    #[error("label selector on {key:?}: values set must be empty for operator {operator}")]
    ValuesForbidden { key: String, operator: String },
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
    Exists(String),
    DoesNotExist(String),
}

impl Requirement {
    fn matches(&self, labels: &Labels) -> bool {
        match self {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
        }
    }

    /// The one label a requirement reads.
    fn key(&self) -> &str {
        match self {
            Requirement::Equals(k, _)
            | Requirement::In(k, _)
            | Requirement::NotIn(k, _)
            | Requirement::Exists(k)
            | Requirement::DoesNotExist(k) => k,
        }
    }
}

/// A compiled `LabelSelector`: all requirements must hold; none at all matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    pub fn compile(s: &LabelSelector) -> Result<Selector, SelectorError> {
        let mut requirements = Vec::new();
        for (k, v) in &s.match_labels {
            if k.is_empty() {
                return Err(SelectorError::EmptyKey);
            }
            requirements.push(Requirement::Equals(k.clone(), v.clone()));
        }
        for e in &s.match_expressions {
            if e.key.is_empty() {
                return Err(SelectorError::EmptyKey);
            }
            let values: BTreeSet<String> = e.values.iter().cloned().collect();
            let needs_values = match e.operator.as_str() {
                "In" | "NotIn" => true,
                "Exists" | "DoesNotExist" => false,
                other => return Err(SelectorError::Operator(other.to_owned())),
            };
            let (key, operator) = (e.key.clone(), e.operator.clone());
            if needs_values && values.is_empty() {
                return Err(SelectorError::ValuesRequired { key, operator });
            }
            if !needs_values && !values.is_empty() {
                return Err(SelectorError::ValuesForbidden { key, operator });
            }
            requirements.push(match e.operator.as_str() {
                "In" => Requirement::In(key, values),
                "NotIn" => Requirement::NotIn(key, values),
                "Exists" => Requirement::Exists(key),
                _ => Requirement::DoesNotExist(key),
            });
        }
        Ok(Selector { requirements })
    }

    pub fn is_everything(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, labels: &Labels) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }
}

/// What the decision needs from a pod, whatever the pod came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodView {
    pub labels: Labels,
    pub annotations: Labels,
    pub host_network: bool,
}

impl PodView {
    /// From a Pod object as the API server serves it (`metadata.labels`, `metadata.annotations`,
    /// `spec.hostNetwork`); missing fields are empty.
    pub fn from_pod_json(pod: &Value) -> PodView {
        PodView {
            labels: string_map(&pod["metadata"]["labels"]),
            annotations: string_map(&pod["metadata"]["annotations"]),
            host_network: pod["spec"]["hostNetwork"].as_bool().unwrap_or(false),
        }
    }
}

/// `metadata.labels` of any object (a Namespace, for the namespace side of the decision).
pub fn labels_from_json(obj: &Value) -> Labels {
    string_map(&obj["metadata"]["labels"])
}

fn string_map(v: &Value) -> Labels {
    v.as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// The enablement selectors, compiled once and asked per pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompiledSelectors {
    pairs: Vec<(Selector, Selector)>,
}

impl CompiledSelectors {
    pub fn compile(selectors: &[EnablementSelector]) -> Result<Self, SelectorError> {
        let pairs = selectors
            .iter()
            .map(|s| {
                Ok((
                    Selector::compile(&s.pod_selector)?,
                    Selector::compile(&s.namespace_selector)?,
                ))
            })
            .collect::<Result<_, SelectorError>>()?;
        Ok(CompiledSelectors { pairs })
    }

    /// Host-network pods and sidecar pods never; otherwise any selector pair matching both the pod
    /// and its namespace.
    pub fn matches(&self, pod: &PodView, namespace_labels: &Labels) -> bool {
        if pod.host_network || pod.annotations.contains_key(SIDECAR_STATUS_ANNOTATION) {
            return false;
        }
        self.pairs
            .iter()
            .any(|(p, n)| p.matches(&pod.labels) && n.matches(namespace_labels))
    }

    /// Whether the namespace itself is selected: some namespace selector that is not "everything"
    /// matches it. Used to decide whether a namespace label change must re-evaluate its pods.
    pub fn matches_namespace(&self, namespace_labels: &Labels) -> bool {
        self.pairs
            .iter()
            .any(|(_, n)| !n.is_everything() && n.matches(namespace_labels))
    }

    /// The namespace labels [`Self::matches`] and [`Self::matches_namespace`] read: a namespace
    /// kept with only these is judged as with all of its labels.
    pub fn namespace_keys(&self) -> LabelKeys {
        self.keys(|(_, n)| n)
    }

    /// The pod labels [`Self::matches`] reads: a pod kept with only these is judged as with all
    /// of its labels.
    pub fn pod_keys(&self) -> LabelKeys {
        self.keys(|(p, _)| p)
    }

    /// The keys the requirements of one side of every pair name.
    fn keys(&self, side: impl Fn(&(Selector, Selector)) -> &Selector) -> LabelKeys {
        LabelKeys(
            self.pairs
                .iter()
                .flat_map(|pair| side(pair).requirements.iter().map(|r| r.key().to_owned()))
                .collect(),
        )
    }
}

/// The label keys something reads, to keep an object's labels to those.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelKeys(BTreeSet<String>);

impl LabelKeys {
    /// `labels` without the entries whose key is not one of these (moved, not copied).
    pub fn retain(&self, mut labels: Labels) -> Labels {
        labels.retain(|k, _| self.0.contains(k));
        labels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One requirement of each operator, on key `k-<operator>`, the `In`s with value `v`.
    fn every_operator() -> Vec<LabelSelectorRequirement> {
        ["In", "NotIn", "Exists", "DoesNotExist"]
            .iter()
            .map(|op| LabelSelectorRequirement {
                key: format!("k-{op}"),
                operator: (*op).into(),
                values: if op.ends_with("In") {
                    vec!["v".into()]
                } else {
                    vec![]
                },
            })
            .collect()
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    const AMBIENT: &[(&str, &str)] = &[(DATAPLANE_MODE_LABEL, "ambient")];
    const NONE: &[(&str, &str)] = &[(DATAPLANE_MODE_LABEL, "none")];
    const SIDECAR: &[(&str, &str)] = &[(SIDECAR_STATUS_ANNOTATION, "{}")];

    /// Istio's `TestEnablementSelectorMatches`, case for case, with the default selectors.
    #[test]
    fn istio_enablement_selector_cases() {
        let sel = CompiledSelectors::compile(&default_selectors()).unwrap();
        type Pairs = &'static [(&'static str, &'static str)];
        // (case, pod labels, pod annotations, hostNetwork, namespace labels, expected)
        let cases: [(&str, Pairs, Pairs, bool, Pairs, bool); 9] = [
            ("namespace ambient", &[], &[], false, AMBIENT, true),
            ("pod ambient", AMBIENT, &[], false, &[], true),
            ("both ambient", AMBIENT, &[], false, AMBIENT, true),
            ("neither", &[], &[], false, &[], false),
            (
                "sidecar in ambient namespace",
                &[],
                SIDECAR,
                false,
                AMBIENT,
                false,
            ),
            (
                "pod opted out in ambient namespace",
                NONE,
                &[],
                false,
                AMBIENT,
                false,
            ),
            (
                "sidecar with ambient pod label",
                AMBIENT,
                SIDECAR,
                false,
                &[],
                false,
            ),
            (
                "host network in ambient namespace",
                &[],
                &[],
                true,
                AMBIENT,
                false,
            ),
            (
                "host network with ambient pod label",
                AMBIENT,
                &[],
                true,
                &[],
                false,
            ),
        ];
        for (name, pod_labels, annotations, host_network, ns, want) in cases {
            let pod = PodView {
                labels: labels(pod_labels),
                annotations: labels(annotations),
                host_network,
            };
            assert_eq!(sel.matches(&pod, &labels(ns)), want, "{name}");
        }
    }

    #[test]
    fn ambient_pod_in_none_namespace_is_in() {
        let sel = CompiledSelectors::compile(&default_selectors()).unwrap();
        let pod = PodView {
            labels: labels(AMBIENT),
            ..Default::default()
        };
        assert!(sel.matches(&pod, &labels(NONE)));
    }

    #[test]
    fn matches_namespace_skips_match_all() {
        let sel = CompiledSelectors::compile(&default_selectors()).unwrap();
        assert!(sel.matches_namespace(&labels(AMBIENT)));
        assert!(!sel.matches_namespace(&labels(NONE)));
        assert!(!sel.matches_namespace(&labels(&[])));
        // Only match-all namespace selectors: no namespace is "selected".
        let only_pods = CompiledSelectors::compile(&default_selectors()[..1]).unwrap();
        assert!(!only_pods.matches_namespace(&labels(AMBIENT)));
    }

    #[test]
    fn namespace_keys_are_the_labels_namespace_selectors_read() {
        let sel = CompiledSelectors::compile(&default_selectors()).unwrap();
        let keys = sel.namespace_keys();
        let all = labels(&[
            (DATAPLANE_MODE_LABEL, "ambient"),
            ("kubernetes.io/metadata.name", "web"),
            ("team", "a"),
        ]);
        assert_eq!(keys.retain(all.clone()), labels(AMBIENT));
        assert_eq!(keys.retain(labels(&[("team", "a")])), Labels::new());
        // Every kind of requirement names its key; pod selectors' keys are not namespace keys.
        let custom = CompiledSelectors::compile(&[EnablementSelector {
            pod_selector: LabelSelector {
                match_labels: labels(&[("app", "web")]),
                ..Default::default()
            },
            namespace_selector: LabelSelector {
                match_labels: labels(&[("team", "a")]),
                match_expressions: every_operator(),
            },
        }])
        .unwrap();
        let with_all = labels(&[
            ("team", "a"),
            ("app", "web"),
            ("k-In", "v"),
            ("k-NotIn", "x"),
            ("k-Exists", ""),
            ("k-DoesNotExist", ""),
            ("other", "o"),
        ]);
        let kept = custom.namespace_keys().retain(with_all.clone());
        assert_eq!(
            kept.keys().map(String::as_str).collect::<Vec<_>>(),
            ["k-DoesNotExist", "k-Exists", "k-In", "k-NotIn", "team"]
        );
        let pod = PodView {
            labels: labels(&[("app", "web")]),
            ..Default::default()
        };
        assert_eq!(custom.matches(&pod, &kept), custom.matches(&pod, &with_all));
    }

    #[test]
    fn pod_keys_are_the_labels_pod_selectors_read() {
        let sel = CompiledSelectors::compile(&default_selectors()).unwrap();
        let all = labels(&[(DATAPLANE_MODE_LABEL, "none"), ("app", "web")]);
        assert_eq!(sel.pod_keys().retain(all), labels(NONE));
        // Namespace selectors' keys are not pod keys; every operator names its key.
        let custom = CompiledSelectors::compile(&[EnablementSelector {
            pod_selector: LabelSelector {
                match_labels: labels(&[("app", "web")]),
                match_expressions: every_operator(),
            },
            namespace_selector: LabelSelector {
                match_labels: labels(&[("team", "a")]),
                ..Default::default()
            },
        }])
        .unwrap();
        let ns = labels(&[("team", "a")]);
        for pod_labels in [
            labels(&[
                ("app", "web"),
                ("k-In", "v"),
                ("k-NotIn", "x"),
                ("k-Exists", ""),
            ]),
            labels(&[
                ("app", "web"),
                ("k-In", "v"),
                ("k-Exists", ""),
                ("k-DoesNotExist", ""),
            ]),
            labels(&[
                ("app", "web"),
                ("k-In", "v"),
                ("k-Exists", ""),
                ("team", "a"),
                ("o", "o"),
            ]),
        ] {
            let kept = custom.pod_keys().retain(pod_labels.clone());
            assert!(
                kept.keys().all(|k| k == "app" || k.starts_with("k-")),
                "{kept:?}"
            );
            let (whole, trimmed) = (
                PodView {
                    labels: pod_labels,
                    ..Default::default()
                },
                PodView {
                    labels: kept,
                    ..Default::default()
                },
            );
            assert_eq!(custom.matches(&trimmed, &ns), custom.matches(&whole, &ns));
        }
    }

    #[test]
    fn empty_selectors_match_everything_and_no_selectors_nothing() {
        let all = CompiledSelectors::compile(&[EnablementSelector::default()]).unwrap();
        assert!(all.matches(&PodView::default(), &Labels::new()));
        let none = CompiledSelectors::compile(&[]).unwrap();
        assert!(!none.matches(&PodView::default(), &Labels::new()));
    }

    #[test]
    fn operators() {
        let sel = |op: &str, values: &[&str]| {
            Selector::compile(&LabelSelector {
                match_labels: Labels::new(),
                match_expressions: vec![LabelSelectorRequirement {
                    key: "k".into(),
                    operator: op.into(),
                    values: values.iter().map(|v| (*v).to_owned()).collect(),
                }],
            })
        };
        let (a, b, empty) = (labels(&[("k", "a")]), labels(&[("k", "b")]), Labels::new());
        let s = sel("In", &["a", "c"]).unwrap();
        assert!(s.matches(&a) && !s.matches(&b) && !s.matches(&empty));
        let s = sel("NotIn", &["a"]).unwrap();
        assert!(!s.matches(&a) && s.matches(&b) && s.matches(&empty));
        let s = sel("Exists", &[]).unwrap();
        assert!(s.matches(&a) && !s.matches(&empty));
        let s = sel("DoesNotExist", &[]).unwrap();
        assert!(!s.matches(&a) && s.matches(&empty));
        assert_eq!(
            sel("Gt", &["1"]).unwrap_err(),
            SelectorError::Operator("Gt".into())
        );
        assert!(matches!(
            sel("In", &[]),
            Err(SelectorError::ValuesRequired { .. })
        ));
        assert!(matches!(
            sel("Exists", &["x"]),
            Err(SelectorError::ValuesForbidden { .. })
        ));
    }

    #[test]
    fn match_labels_and_expressions_are_anded() {
        let s = Selector::compile(&LabelSelector {
            match_labels: labels(&[("app", "web")]),
            match_expressions: vec![LabelSelectorRequirement {
                key: "tier".into(),
                operator: "Exists".into(),
                values: vec![],
            }],
        })
        .unwrap();
        assert!(s.matches(&labels(&[("app", "web"), ("tier", "x")])));
        assert!(!s.matches(&labels(&[("app", "web")])));
        assert!(!s.matches(&labels(&[("app", "db"), ("tier", "x")])));
    }

    #[test]
    fn json_form_round_trips_as_the_installer_writes_it() {
        let json = r#"[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}},"namespaceSelector":{}},{"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]},"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]"#;
        let parsed: Vec<EnablementSelector> = serde_json::from_str(json).unwrap();
        assert_eq!(parsed, default_selectors());
        assert_eq!(serde_json::to_string(&parsed).unwrap(), json);
        // Missing or null selectors are empty ones.
        let parsed: Vec<EnablementSelector> =
            serde_json::from_str(r#"[{"podSelector":null},{}]"#).unwrap();
        assert_eq!(
            parsed,
            vec![EnablementSelector::default(), EnablementSelector::default()]
        );
    }

    #[test]
    fn pod_view_from_api_json() {
        let pod = serde_json::json!({
            "metadata": {"name": "p", "labels": {"a": "1"}, "annotations": {"sidecar.istio.io/status": "{}"}},
            "spec": {"hostNetwork": true}
        });
        let v = PodView::from_pod_json(&pod);
        assert_eq!(v.labels, labels(&[("a", "1")]));
        assert!(v.annotations.contains_key(SIDECAR_STATUS_ANNOTATION));
        assert!(v.host_network);
        assert_eq!(
            PodView::from_pod_json(&serde_json::json!({})),
            PodView::default()
        );
        let ns =
            serde_json::json!({"metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}});
        assert_eq!(labels_from_json(&ns), labels(AMBIENT));
    }
}
