//! Host side of ambient with nftables: the probe address sets (enrolled pod IPs, each tagged with
//! its pod UID) and the postrouting rule that SNATs kubelet's probes to those pods.
//!
//! nftables has no `-m owner --socket-exists`, so kubelet is recognised by the UID of its sockets
//! (`skuid`), discovered from `/proc`.

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use cni_core::redirect::ambient::nft::{HostProbeConfig, NAT_TABLE, host_ruleset, probe_set_name};
use cni_core::redirect::nft::{POSTROUTING, Set};
use netlink_packet_netfilter::nftables::{
    DataAttribute, ListAttribute, NfTablesMessage, SetElementAttribute, SetElementList,
    SetElementMessage,
};

use super::bytes::{find_tlv, nul_terminated, push_tlv, string_of};
use super::wire::{Batch, change, read_set_elements, read_tables};
use super::{NftAccess, NftError, with_socket};
use crate::inpod::RuleState;
use crate::netlink::{NetlinkError, NetlinkSocket};
use crate::netns::Netns;
use netlink_packet_core::NLM_F_EXCL;

/// libnftnl user-data TLV of a set element's comment.
const UDATA_SET_ELEM_COMMENT: u8 = 0;
const ENOENT: i32 = 2;

/// Programs the host table: the probe set(s), kept with their elements when they already exist,
/// then every rule of the table replaced by the desired ones: the steps
/// [`Table::render`](cni_core::redirect::nft::Table::render) writes (Istio's set and rule
/// transactions), in one batch. Safe to repeat.
pub fn apply_host_rules(netns: &Netns, cfg: &HostProbeConfig) -> Result<(), NftError> {
    let ruleset = host_ruleset(cfg);
    let mut batch = Batch::default();
    for table in &ruleset.tables {
        batch.add_table(&table.name);
        for (i, set) in table.sets.iter().enumerate() {
            batch.add_set(&table.name, set, i as u32 + 1);
        }
        batch.flush_table(&table.name);
        batch.add_contents(table);
    }
    with_socket(netns, move |sock| batch.commit(sock))
}

/// The host table (its sets and the SNAT rule) against [`host_ruleset`]: what a firewall reload
/// or `nft flush ruleset` took. The sets' elements are not compared; [`ProbeSets::list`] reads
/// them.
pub fn verify_host_rules(netns: &Netns, cfg: &HostProbeConfig) -> Result<RuleState, NftError> {
    let actual = with_socket(netns, |sock| read_tables(sock, &[NAT_TABLE]))?;
    Ok(super::state_of(&host_ruleset(cfg), &actual))
}

/// Removes the SNAT rule (its whole chain) but keeps the table and the sets with their elements,
/// as on an agent restart.
pub fn remove_host_rules(netns: &Netns) -> Result<(), NftError> {
    let mut batch = Batch::default();
    batch.add_table(NAT_TABLE);
    let postrouting = cni_core::redirect::nft::Chain::regular(POSTROUTING);
    batch.add_chain(NAT_TABLE, &postrouting);
    batch.push(change(
        NfTablesMessage::DeleteChain(netlink_packet_netfilter::nftables::ChainMessage {
            attributes: vec![
                netlink_packet_netfilter::nftables::ChainAttribute::Table(NAT_TABLE.to_string()),
                netlink_packet_netfilter::nftables::ChainAttribute::Name(POSTROUTING.to_string()),
            ],
        }),
        0,
    ));
    with_socket(netns, move |sock| batch.commit(sock))
}

/// Deletes the host table, sets included (full shutdown).
pub fn destroy_host_table(netns: &Netns) -> Result<(), NftError> {
    let mut batch = Batch::default();
    batch.ensure_no_table(NAT_TABLE);
    with_socket(netns, move |sock| batch.commit(sock))
}

/// One enrolled pod address in a probe set.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProbeEntry {
    pub ip: IpAddr,
    pub pod_uid: String,
}

/// The probe sets of the host table. IPv6 addresses are skipped when IPv6 is disabled, as
/// Istio does, because the v6 set does not exist then.
#[derive(Clone, Copy, Debug)]
pub struct ProbeSets {
    pub ipv6: bool,
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn element_msg(set: &str, elems: Vec<Vec<SetElementAttribute>>, delete: bool) -> NfTablesMessage {
    let msg = SetElementMessage {
        attributes: vec![
            SetElementList::Table(NAT_TABLE.to_string()),
            SetElementList::Set(set.to_string()),
            SetElementList::Elements(elems.into_iter().map(ListAttribute::Element).collect()),
        ],
    };
    if delete {
        NfTablesMessage::DeleteSetElement(msg)
    } else {
        NfTablesMessage::NewSetElement(msg)
    }
}

fn key(ip: IpAddr) -> SetElementAttribute {
    SetElementAttribute::Key(DataAttribute::Value(ip_bytes(ip)))
}

impl ProbeSets {
    fn set_for(&self, ip: IpAddr) -> Option<String> {
        match ip {
            IpAddr::V4(_) => Some(probe_set_name(false)),
            IpAddr::V6(_) if self.ipv6 => Some(probe_set_name(true)),
            IpAddr::V6(_) => None,
        }
    }

    /// Adds `ip` tagged with `pod_uid`, replacing the tag of an existing entry, in one batch.
    /// Returns false when the address was skipped (IPv6 disabled).
    pub fn upsert(&self, at: &impl NftAccess, ip: IpAddr, pod_uid: &str) -> Result<bool, NftError> {
        Ok(self.upsert_many(at, &[(ip, pod_uid)])? > 0)
    }

    /// [`upsert`](Self::upsert) for many entries (agent restart restores every enrolled pod at
    /// once). Returns how many entries were not skipped.
    ///
    /// New addresses (the common case: a pod just got its IP) are only added. Replacing a tag
    /// needs a delete, and a commit after a delete waits for the kernel to free the old element
    /// (an RCU grace period, ~15 ms here) — paid only when an address really is reused.
    ///
    /// With more than one entry, the entries the set already holds with the same tag are left
    /// alone (after an agent restart: all of them), and the rest go in batches of
    /// [`ELEMENTS_PER_BATCH`]: the kernel acks every message of a batch, and a few hundred acks
    /// at once overflow the socket's receive buffer (`ENOBUFS`, seen with 250 pods).
    pub fn upsert_many(
        &self,
        at: &impl NftAccess,
        entries: &[(IpAddr, &str)],
    ) -> Result<usize, NftError> {
        let elems: Vec<(String, IpAddr, String)> = entries
            .iter()
            .filter_map(|(ip, uid)| {
                // Istio stores IPv4-mapped IPv6 addresses as plain IPv4.
                let ip = ip.to_canonical();
                Some((self.set_for(ip)?, ip, uid.to_string()))
            })
            .collect();
        let count = elems.len();
        if elems.is_empty() {
            return Ok(0);
        }
        let sets = self.set_names();
        at.with_sock(move |sock| {
            let todo: Vec<(String, IpAddr, String)> = if elems.len() > 1 {
                let mut present = HashSet::new();
                for set in &sets {
                    present.extend(list_set(sock, set)?.into_iter().map(|e| (e.ip, e.pod_uid)));
                }
                elems
                    .into_iter()
                    .filter(|(_, ip, uid)| !present.contains(&(*ip, uid.clone())))
                    .collect()
            } else {
                elems
            };
            for chunk in todo.chunks(ELEMENTS_PER_BATCH) {
                upsert_batch(sock, chunk)?;
            }
            Ok(())
        })?;
        Ok(count)
    }

    fn set_names(&self) -> Vec<String> {
        std::iter::once(probe_set_name(false))
            .chain(self.ipv6.then(|| probe_set_name(true)))
            .collect()
    }

    pub fn list(&self, at: &impl NftAccess) -> Result<Vec<ProbeEntry>, NftError> {
        let sets = self.set_names();
        at.with_sock(move |sock| {
            let mut out = Vec::new();
            for set in &sets {
                out.extend(list_set(sock, set)?);
            }
            Ok(out)
        })
    }

    /// Deletes `ip` only if it is tagged with `pod_uid` (another pod may own the IP by now).
    /// Returns whether an entry was removed.
    pub fn remove(&self, at: &impl NftAccess, ip: IpAddr, pod_uid: &str) -> Result<bool, NftError> {
        let ip = ip.to_canonical();
        let found = self
            .list(at)?
            .into_iter()
            .any(|e| e.ip == ip && e.pod_uid == pod_uid);
        if !found {
            return Ok(false);
        }
        self.delete(at, &[ip])?;
        Ok(true)
    }

    /// Deletes every entry whose address is not in `keep`; returns the deleted entries.
    pub fn prune(
        &self,
        at: &impl NftAccess,
        keep: &HashSet<IpAddr>,
    ) -> Result<Vec<ProbeEntry>, NftError> {
        let stale: Vec<ProbeEntry> = self
            .list(at)?
            .into_iter()
            .filter(|e| !keep.contains(&e.ip))
            .collect();
        let ips: Vec<IpAddr> = stale.iter().map(|e| e.ip).collect();
        self.delete(at, &ips)?;
        Ok(stale)
    }

    fn delete(&self, at: &impl NftAccess, ips: &[IpAddr]) -> Result<(), NftError> {
        let msgs: Vec<_> = ips
            .iter()
            .filter_map(|ip| {
                let set = self.set_for(*ip)?;
                Some(change(element_msg(&set, vec![vec![key(*ip)]], true), 0))
            })
            .collect();
        at.with_sock(move |sock| {
            let mut msgs = msgs.into_iter().peekable();
            while msgs.peek().is_some() {
                let mut batch = Batch::default();
                msgs.by_ref()
                    .take(ELEMENTS_PER_BATCH)
                    .for_each(|m| batch.push(m));
                batch.commit(sock)?;
            }
            Ok(())
        })
    }
}

/// Set elements per nf_tables batch: each refused message is answered on its own (every element
/// of an add-only batch whose addresses are all there already), and a few hundred answers
/// overflow the netlink socket's receive buffer (`ENOBUFS`).
pub const ELEMENTS_PER_BATCH: usize = 32;

/// Adds `elems` (set, address, pod UID) in one batch; where an address is already there, the
/// batch is redone replacing its tag.
fn upsert_batch(
    sock: &mut NetlinkSocket,
    elems: &[(String, IpAddr, String)],
) -> Result<(), NetlinkError> {
    let tagged = |set: &str, ip: IpAddr, uid: &str| {
        let mut udata = Vec::new();
        push_tlv(&mut udata, UDATA_SET_ELEM_COMMENT, &nul_terminated(uid));
        element_msg(
            set,
            vec![vec![key(ip), SetElementAttribute::UserData(udata)]],
            false,
        )
    };
    let mut add_only = Batch::default();
    for (set, ip, uid) in elems {
        add_only.push(change(tagged(set, *ip, uid), NLM_F_EXCL));
    }
    match add_only.commit(sock) {
        Err(e) if e.errno() == Some(libc::EEXIST) => {
            let mut replace = Batch::default();
            for (set, ip, uid) in elems {
                // Create-then-delete makes the delete valid whether or not the entry existed.
                replace.push(change(element_msg(set, vec![vec![key(*ip)]], false), 0));
                replace.push(change(element_msg(set, vec![vec![key(*ip)]], true), 0));
                replace.push(change(tagged(set, *ip, uid), 0));
            }
            replace.commit(sock)
        }
        other => other,
    }
}

fn list_set(sock: &mut NetlinkSocket, set: &str) -> Result<Vec<ProbeEntry>, NetlinkError> {
    let elements = match read_set_elements(sock, NAT_TABLE, set) {
        Ok(e) => e,
        // No table or set yet: nothing enrolled.
        Err(e) if e.errno() == Some(ENOENT) => return Ok(vec![]),
        Err(e) => return Err(e),
    };
    Ok(elements
        .into_iter()
        .filter_map(|e| {
            let ip = match e.key.len() {
                4 => <[u8; 4]>::try_from(e.key.as_slice()).ok().map(IpAddr::from),
                16 => <[u8; 16]>::try_from(e.key.as_slice())
                    .ok()
                    .map(IpAddr::from),
                _ => None,
            }?;
            let pod_uid = e
                .user_data
                .as_deref()
                .and_then(|u| find_tlv(u, UDATA_SET_ELEM_COMMENT))
                .map(string_of)
                .unwrap_or_default();
            Some(ProbeEntry { ip, pod_uid })
        })
        .collect())
}

/// The set definitions the host table carries (for callers that render or explain).
pub fn probe_sets(cfg: &HostProbeConfig) -> Vec<Set> {
    host_ruleset(cfg)
        .tables
        .into_iter()
        .flat_map(|t| t.sets)
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum KubeletUidError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no kubelet process (kubelet, kubelite or k3s) found under {0}")]
    NotFound(PathBuf),
}

/// Whether a process is kubelet: `kubelet`, or MicroK8s' `kubelite`, whose command line must
/// name kubelet in any letter case (Istio lowercases each argument before looking, so
/// `/opt/Kubelet/bin/kubelite` counts); or `k3s`, which embeds kubelet in its single binary.
pub fn is_kubelet(comm: &str, cmdline: &[u8]) -> bool {
    let names_kubelet = || {
        cmdline.split(|b| *b == 0).any(|arg| {
            String::from_utf8_lossy(arg)
                .to_lowercase()
                .contains("kubelet")
        })
    };
    match comm.trim_end() {
        "kubelet" | "kubelite" => names_kubelet(),
        "k3s" => true,
        _ => false,
    }
}

/// The real UID from a `/proc/<pid>/status` text (`Uid:\treal\teffective\tsaved\tfs`).
pub fn real_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|uid| uid.parse().ok())
}

/// Finds kubelet among the processes of a `/proc`-like directory (the host's, mounted into the
/// agent) and returns its real UID. Processes are visited in PID order; ones that exit while
/// being read are skipped.
pub fn kubelet_uid(proc_root: &Path) -> Result<u32, KubeletUidError> {
    let read_err = |source| KubeletUidError::Read {
        path: proc_root.to_owned(),
        source,
    };
    let mut pids: Vec<u32> = std::fs::read_dir(proc_root)
        .map_err(read_err)?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    for pid in pids {
        let dir = proc_root.join(pid.to_string());
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
        if !is_kubelet(&comm, &cmdline) {
            continue;
        }
        if let Some(uid) = std::fs::read_to_string(dir.join("status"))
            .ok()
            .as_deref()
            .and_then(real_uid)
        {
            return Ok(uid);
        }
    }
    Err(KubeletUidError::NotFound(proc_root.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_elements_decode_as_the_netlink_crate_encodes_them() {
        use super::super::wire::{SetElement, decode_set_elements};
        use netlink_packet_core::NetlinkSerializable;
        use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};
        let mut udata = Vec::new();
        push_tlv(&mut udata, UDATA_SET_ELEM_COMMENT, &nul_terminated("uid-1"));
        let v4: IpAddr = "10.244.0.7".parse().unwrap();
        let v6: IpAddr = "fd00::7".parse().unwrap();
        let msg = NetfilterMessage::new(
            NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0),
            element_msg(
                "probes",
                vec![
                    vec![key(v4), SetElementAttribute::UserData(udata.clone())],
                    vec![key(v6)],
                ],
                false,
            ),
        );
        let mut payload = vec![0; msg.buffer_len()];
        msg.serialize(&mut payload);
        let elements = decode_set_elements(&payload).unwrap();
        assert_eq!(
            elements,
            [
                SetElement {
                    key: ip_bytes(v4),
                    user_data: Some(udata),
                },
                SetElement {
                    key: ip_bytes(v6),
                    user_data: None,
                },
            ]
        );
        // A length running past the end is an error naming the message, not a panic.
        let err = decode_set_elements(&payload[..payload.len() - 3]);
        assert!(
            err.unwrap_err()
                .to_string()
                .contains("malformed set element message"),
            "truncated"
        );
    }

    fn proc_entry(root: &Path, pid: u32, comm: &str, cmdline: &[&str], uid: u32) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
        let mut cmd = Vec::new();
        for arg in cmdline {
            cmd.extend_from_slice(arg.as_bytes());
            cmd.push(0);
        }
        std::fs::write(dir.join("cmdline"), cmd).unwrap();
        std::fs::write(
            dir.join("status"),
            format!("Name:\t{comm}\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t{uid}\t0\t0\t0\nGid:\t0\t0\t0\t0\n"),
        )
        .unwrap();
    }

    #[test]
    fn finds_kubelet_by_comm_and_cmdline() {
        let root = tempfile::tempdir().unwrap();
        proc_entry(root.path(), 1, "systemd", &["/sbin/init"], 0);
        proc_entry(
            root.path(),
            42,
            "kubelet",
            &["/usr/bin/kubelet", "--config=/x"],
            1234,
        );
        std::fs::create_dir(root.path().join("self")).unwrap();
        assert_eq!(kubelet_uid(root.path()).unwrap(), 1234);
    }

    #[test]
    fn kubelite_needs_kubelet_on_its_command_line() {
        let root = tempfile::tempdir().unwrap();
        proc_entry(
            root.path(),
            10,
            "kubelite",
            &["/snap/bin/kubelite", "--apiserver"],
            7,
        );
        assert!(matches!(
            kubelet_uid(root.path()),
            Err(KubeletUidError::NotFound(_))
        ));
        proc_entry(
            root.path(),
            11,
            "kubelite",
            &["/snap/bin/kubelite", "--kubelet-args-file=/x"],
            8,
        );
        assert_eq!(kubelet_uid(root.path()).unwrap(), 8);
    }

    #[test]
    fn kubelet_on_the_command_line_is_matched_in_any_case() {
        let root = tempfile::tempdir().unwrap();
        proc_entry(
            root.path(),
            20,
            "kubelite",
            &["/opt/KUBELET/kubelite", "--Kubelet-Args-File=/x"],
            9,
        );
        assert_eq!(kubelet_uid(root.path()).unwrap(), 9);
        assert!(is_kubelet("kubelet", b"/usr/bin/KubeLet\0--v=2\0"));
        assert!(!is_kubelet("kubelet", b"/usr/bin/kube\0let\0"));
    }

    #[test]
    fn k3s_needs_no_cmdline() {
        let root = tempfile::tempdir().unwrap();
        proc_entry(root.path(), 5, "k3s", &["/usr/local/bin/k3s", "server"], 0);
        assert_eq!(kubelet_uid(root.path()).unwrap(), 0);
    }

    #[test]
    fn a_kubelet_named_process_without_kubelet_args_is_ignored_and_none_is_an_error() {
        let root = tempfile::tempdir().unwrap();
        proc_entry(root.path(), 3, "kubelet", &["/bin/sleep", "100"], 5);
        proc_entry(root.path(), 4, "bash", &["bash"], 1000);
        assert!(matches!(
            kubelet_uid(root.path()),
            Err(KubeletUidError::NotFound(_))
        ));
        assert!(kubelet_uid(&root.path().join("missing")).is_err());
    }

    #[test]
    fn real_uid_is_the_first_uid_column() {
        assert_eq!(real_uid("Name:\tx\nUid:\t1000\t0\t0\t0\n"), Some(1000));
        assert_eq!(real_uid("Name:\tx\n"), None);
    }
}
