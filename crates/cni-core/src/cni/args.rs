//! `CNI_ARGS`: `K=V;K=V` pairs. Kubelet-driven runtimes pass the pod's identity here, always with
//! `IgnoreUnknown=1`; without it, an unknown key is an error (libcni `types.LoadArgs`).

/// The keys Istio's plugin reads; anything else is unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct K8sArgs {
    pub ignore_unknown: bool,
    pub pod_name: String,
    pub pod_namespace: String,
    pub pod_infra_container_id: String,
    pub pod_uid: String,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArgsError {
    #[error("ARGS: invalid pair {0:?}")]
    InvalidPair(String),
    #[error(
        "ARGS: error parsing value of pair {pair:?}: boolean unmarshal error: invalid input {value}"
    )]
    InvalidBool { pair: String, value: String },
    #[error("ARGS: unknown args [{}]", .0.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(" "))]
    Unknown(Vec<String>),
}

impl K8sArgs {
    pub fn parse(args: &str) -> Result<Self, ArgsError> {
        let mut out = K8sArgs::default();
        if args.is_empty() {
            return Ok(out);
        }
        let mut unknown = Vec::new();
        for pair in args.split(';') {
            let kv: Vec<&str> = pair.split('=').collect();
            let [key, value] = kv[..] else {
                return Err(ArgsError::InvalidPair(pair.to_owned()));
            };
            match key {
                "IgnoreUnknown" => {
                    out.ignore_unknown = match value.to_lowercase().as_str() {
                        "1" | "true" => true,
                        "0" | "false" => false,
                        other => {
                            return Err(ArgsError::InvalidBool {
                                pair: pair.to_owned(),
                                value: other.to_owned(),
                            });
                        }
                    }
                }
                "K8S_POD_NAME" => out.pod_name = value.to_owned(),
                "K8S_POD_NAMESPACE" => out.pod_namespace = value.to_owned(),
                "K8S_POD_INFRA_CONTAINER_ID" => out.pod_infra_container_id = value.to_owned(),
                "K8S_POD_UID" => out.pod_uid = value.to_owned(),
                _ => unknown.push(pair.to_owned()),
            }
        }
        if !unknown.is_empty() && !out.ignore_unknown {
            return Err(ArgsError::Unknown(unknown));
        }
        Ok(out)
    }

    /// Both name and namespace are set: the sandbox belongs to a Kubernetes pod.
    pub fn is_pod(&self) -> bool {
        !self.pod_name.is_empty() && !self.pod_namespace.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_containerd_sends() {
        let a = K8sArgs::parse(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;\
             K8S_POD_INFRA_CONTAINER_ID=abc123;K8S_POD_UID=863b91d4-4b68;FOO=bar",
        )
        .unwrap();
        assert_eq!(
            a,
            K8sArgs {
                ignore_unknown: true,
                pod_name: "web-0".into(),
                pod_namespace: "default".into(),
                pod_infra_container_id: "abc123".into(),
                pod_uid: "863b91d4-4b68".into(),
            }
        );
        assert!(a.is_pod());
    }

    #[test]
    fn ignore_unknown_may_come_last_and_in_any_case() {
        let a = K8sArgs::parse("FOO=bar;K8S_POD_NAME=p;IgnoreUnknown=True").unwrap();
        assert_eq!(a.pod_name, "p");
        assert!(!a.is_pod());
    }

    #[test]
    fn empty_is_not_a_pod() {
        assert_eq!(K8sArgs::parse("").unwrap(), K8sArgs::default());
        assert!(!K8sArgs::default().is_pod());
    }

    #[test]
    fn errors_match_libcni_text() {
        assert_eq!(
            K8sArgs::parse("FOO=bar;BAZ=1").unwrap_err().to_string(),
            r#"ARGS: unknown args ["FOO=bar" "BAZ=1"]"#
        );
        assert_eq!(
            K8sArgs::parse("K8S_POD_NAME=a=b").unwrap_err().to_string(),
            r#"ARGS: invalid pair "K8S_POD_NAME=a=b""#
        );
        assert_eq!(
            K8sArgs::parse("K8S_POD_NAME=a;").unwrap_err(),
            ArgsError::InvalidPair(String::new())
        );
        assert_eq!(
            K8sArgs::parse("IgnoreUnknown=yes").unwrap_err().to_string(),
            r#"ARGS: error parsing value of pair "IgnoreUnknown=yes": boolean unmarshal error: invalid input yes"#
        );
        // Keys are case-sensitive, as Go's field lookup is.
        assert!(matches!(
            K8sArgs::parse("k8s_pod_name=a"),
            Err(ArgsError::Unknown(_))
        ));
    }
}
