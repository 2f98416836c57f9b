//! Repair settings with Istio's flag and env names and defaults (istio-cni.md §6.1), parsed like
//! the rest of the agent's configuration and validated into [`RepairConfig`].
//!
//! One deliberate difference: Istio builds its pod watch from `REPAIR_NODE_NAME` alone, so the
//! chart-less default (empty) selects `spec.nodeName=`, i.e. only unscheduled pods, although the
//! flag's help promises all nodes. Here an empty `REPAIR_NODE_NAME` falls back to `NODE_NAME` (the
//! node the DaemonSet pod runs on), and an action without any node name is a configuration error:
//! a node agent has no business repairing pods cluster-wide.

use clap::{ArgAction, Args};

use crate::config::{ConfigError, go_bool};

#[derive(Args, Debug, Clone)]
pub struct RepairArgs {
    /// Watch for pods whose sidecar redirection is missing (the CNI race) and act on them.
    #[arg(long, env = "REPAIR_ENABLED", default_value = "true", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub repair_enabled: bool,
    /// Delete broken pods so they are recreated with the plugin in place.
    #[arg(long, env = "REPAIR_DELETE_PODS", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub repair_delete_pods: bool,
    /// Label broken pods (`REPAIR_BROKEN_POD_LABEL_KEY=REPAIR_BROKEN_POD_LABEL_VALUE`).
    #[arg(long, env = "REPAIR_LABEL_PODS", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub repair_label_pods: bool,
    /// Program the sidecar redirection inside broken pods' network namespaces. Istio reads this
    /// from the environment only; the flag is hidden for that reason.
    #[arg(long, env = "REPAIR_REPAIR_PODS", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, hide = true, global = true)]
    pub repair_repair_pods: bool,
    #[arg(
        long,
        env = "REPAIR_BROKEN_POD_LABEL_KEY",
        default_value = "cni.istio.io/uninitialized",
        global = true
    )]
    pub repair_broken_pod_label_key: String,
    #[arg(
        long,
        env = "REPAIR_BROKEN_POD_LABEL_VALUE",
        default_value = "true",
        global = true
    )]
    pub repair_broken_pod_label_value: String,
    /// Node whose pods are repaired; empty means `NODE_NAME`.
    #[arg(long, env = "REPAIR_NODE_NAME", default_value = "", global = true)]
    pub repair_node_name: String,
    /// Only pods carrying this annotation are candidates (empty: every pod).
    #[arg(
        long,
        env = "REPAIR_SIDECAR_ANNOTATION",
        default_value = "sidecar.istio.io/status",
        global = true
    )]
    pub repair_sidecar_annotation: String,
    /// Init container whose failures mark a pod broken (empty: any init container).
    #[arg(
        long,
        env = "REPAIR_INIT_CONTAINER_NAME",
        default_value = "istio-validation",
        global = true
    )]
    pub repair_init_container_name: String,
    /// Required termination message of that container (empty: any).
    #[arg(
        long,
        env = "REPAIR_INIT_CONTAINER_TERMINATION_MESSAGE",
        default_value = "",
        global = true
    )]
    pub repair_init_container_termination_message: String,
    /// Required exit code of that container (0: any).
    #[arg(
        long,
        env = "REPAIR_INIT_CONTAINER_EXIT_CODE",
        default_value = "126",
        global = true
    )]
    pub repair_init_container_exit_code: i32,
    /// Label selector narrowing the watched pods.
    #[arg(
        long,
        env = "REPAIR_LABEL_SELECTORS",
        default_value = "",
        global = true
    )]
    pub repair_label_selectors: String,
    /// Field selectors added to `spec.nodeName=<node>`.
    #[arg(
        long,
        env = "REPAIR_FIELD_SELECTORS",
        default_value = "",
        global = true
    )]
    pub repair_field_selectors: String,
}

/// What is done to a broken pod. When several are enabled, the first of repair, delete, label wins
/// (Istio's order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairAction {
    Repair,
    Delete,
    Label,
}

impl RepairAction {
    /// The `type` label of `istio_cni_repair_pods_repaired_total`.
    pub fn metric_type(self) -> &'static str {
        match self {
            RepairAction::Repair => "repair",
            RepairAction::Delete => "delete",
            RepairAction::Label => "label",
        }
    }
}

/// Which pods count as broken (Istio's `matchesFilter` inputs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokenPodFilter {
    pub sidecar_annotation: String,
    pub init_container_name: String,
    pub termination_message: String,
    pub exit_code: i32,
}

impl Default for BrokenPodFilter {
    fn default() -> Self {
        BrokenPodFilter {
            sidecar_annotation: "sidecar.istio.io/status".into(),
            init_container_name: "istio-validation".into(),
            termination_message: String::new(),
            exit_code: 126,
        }
    }
}

/// Validated repair settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairConfig {
    pub action: RepairAction,
    pub node_name: String,
    pub label_key: String,
    pub label_value: String,
    pub filter: BrokenPodFilter,
    /// Empty: no label selector.
    pub label_selector: String,
    /// `REPAIR_FIELD_SELECTORS` joined with `spec.nodeName=<node>`.
    pub field_selector: String,
}

impl RepairConfig {
    /// `None` when repair is disabled or no action is selected: Istio still watches pods then,
    /// but nothing can come of it, so we skip the watch (and the RBAC it needs).
    /// `node_name` is `NODE_NAME`, the fallback for an empty `REPAIR_NODE_NAME`.
    pub fn from_args(a: &RepairArgs, node_name: Option<&str>) -> Result<Option<Self>, ConfigError> {
        if !a.repair_enabled {
            return Ok(None);
        }
        let action = if a.repair_repair_pods {
            RepairAction::Repair
        } else if a.repair_delete_pods {
            RepairAction::Delete
        } else if a.repair_label_pods {
            RepairAction::Label
        } else {
            return Ok(None);
        };
        let node_name = [Some(a.repair_node_name.as_str()), node_name]
            .into_iter()
            .flatten()
            .map(str::trim)
            .find(|n| !n.is_empty())
            .ok_or_else(|| ConfigError::Invalid {
                option: "REPAIR_NODE_NAME",
                reason: "neither REPAIR_NODE_NAME nor NODE_NAME is set".into(),
            })?
            .to_string();
        if action == RepairAction::Label && a.repair_broken_pod_label_key.trim().is_empty() {
            return Err(ConfigError::Invalid {
                option: "REPAIR_BROKEN_POD_LABEL_KEY",
                reason: "must not be empty when REPAIR_LABEL_PODS is set".into(),
            });
        }
        let extra = a.repair_field_selectors.trim();
        let node_selector = format!("spec.nodeName={node_name}");
        let field_selector = if extra.is_empty() {
            node_selector
        } else {
            format!("{extra},{node_selector}")
        };
        Ok(Some(RepairConfig {
            action,
            node_name,
            label_key: a.repair_broken_pod_label_key.trim().to_string(),
            label_value: a.repair_broken_pod_label_value.clone(),
            filter: BrokenPodFilter {
                sidecar_annotation: a.repair_sidecar_annotation.clone(),
                init_container_name: a.repair_init_container_name.clone(),
                termination_message: a.repair_init_container_termination_message.clone(),
                exit_code: a.repair_init_container_exit_code,
            },
            label_selector: a.repair_label_selectors.trim().to_string(),
            field_selector,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct P {
        #[command(flatten)]
        repair: RepairArgs,
    }

    fn parse(
        argv: &[&str],
        env: &[(&str, &str)],
        node: Option<&str>,
    ) -> Result<Option<RepairConfig>, String> {
        let env: HashMap<&str, &str> = env.iter().copied().collect();
        let p: P = crate::config::parse_from(
            std::iter::once("install-cni").chain(argv.iter().copied()),
            &env,
        )
        .map_err(|e| e.to_string())?;
        RepairConfig::from_args(&p.repair, node).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_select_no_action() {
        assert_eq!(parse(&[], &[], Some("node-a")).unwrap(), None);
    }

    #[test]
    fn helm_style_environment() {
        let c = parse(
            &[],
            &[
                ("REPAIR_LABEL_PODS", "true"),
                ("REPAIR_NODE_NAME", "node-a"),
                ("REPAIR_BROKEN_POD_LABEL_KEY", "broken"),
                ("REPAIR_BROKEN_POD_LABEL_VALUE", "yes"),
                ("REPAIR_INIT_CONTAINER_EXIT_CODE", "55"),
                ("REPAIR_INIT_CONTAINER_TERMINATION_MESSAGE", "boom"),
                ("REPAIR_LABEL_SELECTORS", "app=x"),
                ("REPAIR_FIELD_SELECTORS", "metadata.namespace=apps"),
            ],
            Some("ignored"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.action, RepairAction::Label);
        assert_eq!(c.node_name, "node-a");
        assert_eq!(
            (c.label_key.as_str(), c.label_value.as_str()),
            ("broken", "yes")
        );
        assert_eq!(c.filter.exit_code, 55);
        assert_eq!(c.filter.termination_message, "boom");
        assert_eq!(c.filter.sidecar_annotation, "sidecar.istio.io/status");
        assert_eq!(c.filter.init_container_name, "istio-validation");
        assert_eq!(c.label_selector, "app=x");
        assert_eq!(
            c.field_selector,
            "metadata.namespace=apps,spec.nodeName=node-a"
        );
    }

    #[test]
    fn first_enabled_action_wins_in_istio_order() {
        let all = [
            ("REPAIR_REPAIR_PODS", "true"),
            ("REPAIR_DELETE_PODS", "true"),
            ("REPAIR_LABEL_PODS", "true"),
        ];
        let n = Some("n");
        assert_eq!(
            parse(&[], &all, n).unwrap().unwrap().action,
            RepairAction::Repair
        );
        assert_eq!(
            parse(&[], &all[1..], n).unwrap().unwrap().action,
            RepairAction::Delete
        );
        assert_eq!(
            parse(&["--repair-label-pods"], &[], n)
                .unwrap()
                .unwrap()
                .action,
            RepairAction::Label
        );
        // Disabled wins over every action.
        assert_eq!(parse(&["--repair-enabled=false"], &all, n).unwrap(), None);
    }

    #[test]
    fn empty_repair_node_name_falls_back_to_node_name() {
        let c = parse(&[], &[("REPAIR_DELETE_PODS", "true")], Some("node-b"))
            .unwrap()
            .unwrap();
        assert_eq!(c.node_name, "node-b");
        assert_eq!(c.field_selector, "spec.nodeName=node-b");
        // Istio would watch `spec.nodeName=` (unscheduled pods only); we refuse instead.
        let err = parse(&[], &[("REPAIR_DELETE_PODS", "true")], Some("")).unwrap_err();
        assert!(err.contains("REPAIR_NODE_NAME"), "{err}");
        let err = parse(&[], &[("REPAIR_DELETE_PODS", "true")], None).unwrap_err();
        assert!(err.contains("NODE_NAME"), "{err}");
    }

    #[test]
    fn invalid_values_are_rejected() {
        let err = parse(&[], &[("REPAIR_LABEL_PODS", "yes")], Some("n")).unwrap_err();
        assert!(err.contains("repair-label-pods"), "{err}");
        let err = parse(&[], &[("REPAIR_INIT_CONTAINER_EXIT_CODE", "x")], Some("n")).unwrap_err();
        assert!(err.contains("repair-init-container-exit-code"), "{err}");
        let err = parse(
            &[],
            &[
                ("REPAIR_LABEL_PODS", "1"),
                ("REPAIR_BROKEN_POD_LABEL_KEY", " "),
            ],
            Some("n"),
        )
        .unwrap_err();
        assert!(err.contains("REPAIR_BROKEN_POD_LABEL_KEY"), "{err}");
    }
}
