//! Host-side pieces of ambient for the iptables backend: the probe SNAT rule (kubelet probes,
//! which come from a local socket, are SNATed to a link-local address the pod rules let through)
//! and the address set of enrolled pod IPs it matches, managed with the `ipset` tool.

use std::net::IpAddr;
use std::process::{Command, Stdio};

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::iptables::host_probe_rules;
use cni_core::redirect::iptables::Family;

use crate::inpod::RuleState;
use crate::iptables::{IptablesBackend, IptablesError};
use crate::netns::Netns;

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    Iptables(#[from] IptablesError),
    #[error("cannot run ipset: {0}")]
    Spawn(std::io::Error),
    #[error("ipset {args}: {stderr}")]
    Ipset { args: String, stderr: String },
    #[error(transparent)]
    Nft(#[from] crate::nft::NftError),
}

fn families(cfg: &InpodConfig) -> Vec<Family> {
    if cfg.ipv6 {
        vec![Family::V4, Family::V6]
    } else {
        vec![Family::V4]
    }
}

fn rules_for(cfg: &InpodConfig) -> impl Fn(Family) -> Vec<cni_core::redirect::iptables::Rule> + '_ {
    move |f| {
        if f == Family::V6 && !cfg.ipv6 {
            Vec::new()
        } else {
            host_probe_rules(cfg, f)
        }
    }
}

/// The rules only load when their sets exist, also where the canonical form is learnt.
fn sets_in(ns: &Netns, cfg: &InpodConfig) -> Result<(), IptablesError> {
    let sets = ProbeSet { host: ns };
    for family in families(cfg) {
        sets.create(family)
            .map_err(|e| IptablesError::Prepare(e.to_string()))?;
    }
    Ok(())
}

/// Creates the probe sets (the rule refers to them) and converges the host SNAT rules.
pub fn apply_rules(
    host: &Netns,
    backend: &IptablesBackend,
    cfg: &InpodConfig,
) -> Result<(), HostError> {
    let sets = ProbeSet { host };
    for family in families(cfg) {
        sets.create(family)?;
    }
    backend.converge_host(host, rules_for(cfg), &|scratch| sets_in(scratch, cfg))?;
    Ok(())
}

pub fn verify_rules(
    host: &Netns,
    backend: &IptablesBackend,
    cfg: &InpodConfig,
) -> Result<RuleState, HostError> {
    Ok(backend.verify_host(host, rules_for(cfg), &|scratch| sets_in(scratch, cfg))?)
}

/// Removes the host rules of both families; the sets are left for [`ProbeSet::destroy`].
pub fn remove_rules(host: &Netns, backend: &IptablesBackend) -> Result<(), HostError> {
    backend.converge_host(host, |_| Vec::new(), &|_| Ok(()))?;
    Ok(())
}

/// The `istio-inpod-probes-v4`/`-v6` sets in the host namespace. Each entry's comment is the UID
/// of the pod that owns the IP, so a recycled IP is never removed on behalf of the wrong pod.
pub struct ProbeSet<'a> {
    pub host: &'a Netns,
}

/// Outcome of a delete by IP and owner.
#[derive(Debug, PartialEq, Eq)]
pub enum Deleted {
    Removed,
    Absent,
    /// The IP belongs to another pod now (its UID is given); the entry stays.
    OwnedByOther(String),
}

impl ProbeSet<'_> {
    fn ipset(&self, args: &[&str]) -> Result<String, HostError> {
        let mut cmd = Command::new("ipset");
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = self
            .host
            .spawn(&mut cmd)
            .and_then(|child| child.wait_with_output())
            .map_err(HostError::Spawn)?;
        if !out.status.success() {
            return Err(HostError::Ipset {
                args: args.join(" "),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn family(ip: &IpAddr) -> Family {
        if ip.is_ipv4() { Family::V4 } else { Family::V6 }
    }

    /// `hash:ip` with comments; an existing set is kept.
    pub fn create(&self, family: Family) -> Result<(), HostError> {
        let inet = if family == Family::V4 {
            "inet"
        } else {
            "inet6"
        };
        self.ipset(&[
            "create",
            &family.probe_set(),
            "hash:ip",
            "family",
            inet,
            "comment",
            "-exist",
        ])?;
        Ok(())
    }

    /// Adds `ip` owned by `uid`, replacing any previous owner.
    pub fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), HostError> {
        let ip = unmapped(ip);
        self.ipset(&[
            "add",
            &Self::family(&ip).probe_set(),
            &ip.to_string(),
            "comment",
            uid,
            "-exist",
        ])?;
        Ok(())
    }

    /// Entries of one family: (IP, owner UID).
    pub fn list(&self, family: Family) -> Result<Vec<(IpAddr, String)>, HostError> {
        let text = self.ipset(&["save", &family.probe_set()])?;
        Ok(text
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                (words.next()? == "add").then_some(())?;
                words.next()?;
                let ip: IpAddr = words.next()?.parse().ok()?;
                let rest: Vec<&str> = words.collect();
                let uid = match rest.iter().position(|w| *w == "comment") {
                    Some(i) => rest
                        .get(i + 1)
                        .map(|c| c.trim_matches('"').to_string())
                        .unwrap_or_default(),
                    None => String::new(),
                };
                Some((ip, uid))
            })
            .collect())
    }

    /// Deletes `ip` only if `uid` owns it.
    pub fn delete(&self, ip: IpAddr, uid: &str) -> Result<Deleted, HostError> {
        let ip = unmapped(ip);
        let family = Self::family(&ip);
        match self.list(family)?.into_iter().find(|(i, _)| *i == ip) {
            None => Ok(Deleted::Absent),
            Some((_, owner)) if owner != uid => Ok(Deleted::OwnedByOther(owner)),
            Some(_) => {
                self.ipset(&["del", &family.probe_set(), &ip.to_string(), "-exist"])?;
                Ok(Deleted::Removed)
            }
        }
    }

    /// Deletes every entry whose IP is not in `keep`; returns how many went.
    pub fn prune(&self, family: Family, keep: &[IpAddr]) -> Result<usize, HostError> {
        let keep: Vec<IpAddr> = keep.iter().copied().map(unmapped).collect();
        let mut removed = 0;
        for (ip, _) in self.list(family)? {
            if !keep.contains(&ip) {
                self.ipset(&["del", &family.probe_set(), &ip.to_string(), "-exist"])?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    pub fn flush(&self, family: Family) -> Result<(), HostError> {
        self.ipset(&["flush", &family.probe_set()])?;
        Ok(())
    }

    /// Destroys the set (after the rule referring to it is gone); absent is fine.
    pub fn destroy(&self, family: Family) -> Result<(), HostError> {
        match self.ipset(&["destroy", &family.probe_set()]) {
            Err(HostError::Ipset { stderr, .. }) if stderr.contains("does not exist") => Ok(()),
            other => other.map(|_| ()),
        }
    }
}

fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::TestNetns;

    #[test]
    fn probe_set_ownership() {
        crate::require_root!();
        let ns = TestNetns::new("ipset");
        let host = ns.open();
        let set = ProbeSet { host: &host };
        set.create(Family::V4).unwrap();
        set.create(Family::V4).unwrap();
        set.create(Family::V6).unwrap();
        let a: IpAddr = "10.1.0.5".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.1.0.6".parse().unwrap();
        let b: IpAddr = "fd00::6".parse().unwrap();
        set.upsert(a, "uid-a").unwrap();
        set.upsert(mapped, "uid-m").unwrap();
        set.upsert(b, "uid-b").unwrap();
        // The IP moved to another pod: the comment follows.
        set.upsert(a, "uid-a2").unwrap();
        let v4 = set.list(Family::V4).unwrap();
        assert!(
            v4.contains(&(a, "uid-a2".into()))
                && v4.contains(&("10.1.0.6".parse().unwrap(), "uid-m".into())),
            "{v4:?}"
        );

        assert_eq!(
            set.delete(a, "uid-a").unwrap(),
            Deleted::OwnedByOther("uid-a2".into())
        );
        assert_eq!(set.delete(a, "uid-a2").unwrap(), Deleted::Removed);
        assert_eq!(set.delete(a, "uid-a2").unwrap(), Deleted::Absent);
        assert_eq!(set.prune(Family::V4, &[]).unwrap(), 1);
        assert_eq!(set.list(Family::V6).unwrap(), [(b, "uid-b".to_string())]);
        set.flush(Family::V6).unwrap();
        assert!(set.list(Family::V6).unwrap().is_empty());
        set.destroy(Family::V4).unwrap();
        set.destroy(Family::V6).unwrap();
        set.destroy(Family::V6).unwrap();
    }

    #[test]
    fn host_rules_apply_verify_remove() {
        crate::require_root!();
        let ns = TestNetns::new("hostrules");
        let host = ns.open();
        let backend = IptablesBackend::detect(Some("nft"), true).unwrap();
        let cfg = InpodConfig {
            ipv6: true,
            ..Default::default()
        };
        apply_rules(&host, &backend, &cfg).unwrap();
        apply_rules(&host, &backend, &cfg).unwrap();
        assert_eq!(
            verify_rules(&host, &backend, &cfg).unwrap(),
            RuleState::InSync
        );
        let save = ns.exec("iptables-nft-save", &["-t", "nat"]);
        assert_eq!(save.matches("-j ISTIO_POSTRT").count(), 1, "{save}");
        assert!(
            save.contains(
                "--match-set istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127"
            ),
            "{save}"
        );
        remove_rules(&host, &backend).unwrap();
        assert!(
            !ns.exec("iptables-nft-save", &["-t", "nat"])
                .contains("ISTIO")
        );
        assert!(
            !ns.exec("ip6tables-nft-save", &["-t", "nat"])
                .contains("ISTIO")
        );
        let set = ProbeSet { host: &host };
        set.destroy(Family::V4).unwrap();
        set.destroy(Family::V6).unwrap();
    }
}
