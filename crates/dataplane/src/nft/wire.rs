//! Tables, chains, sets and rules of the model as nf_tables netlink messages, the batch that
//! carries them, and the dumps that read them back.

use std::collections::HashSet;

use cni_core::redirect::nft::{
    BaseChain, Chain, ChainType, Hook, Rule, Ruleset, Set, SetKey, Table,
};
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_netfilter::nftables::{
    ChainAttribute, ChainMessage, Hook as NlHook, HookNumber, InetHookNumber, NfTablesMessage,
    RuleAttribute, RuleMessage, SetAttribute, SetElementList, SetElementMessage, SetFlags,
    SetMessage, TableAttribute, TableFlags, TableMessage,
};
use netlink_packet_netfilter::none::ControlMessage;
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};

use super::bytes::{find_tlv, nul_terminated, push_tlv, str_of, string_of};
use super::expr::{rule_from_wire, rule_to_netlink};
use crate::netlink::{Encoded, NetlinkError, NetlinkSocket, Nlas, Payloads, Raw};

/// `NFNL_SUBSYS_NFTABLES`: batch begin/end name the subsystem they wrap in `res_id`.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFT_MSG_NEWTABLE: u16 = 0;
pub const NFT_MSG_NEWCHAIN: u16 = 3;
pub const NFT_MSG_NEWRULE: u16 = 6;
pub const NFT_MSG_NEWSET: u16 = 9;
pub const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;
/// `struct nfgenmsg`, ahead of every nf_tables message's attributes.
const NFGENMSG_LEN: usize = 4;
// enum nft_table_attributes, nft_chain_attributes, nft_hook_attributes
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
// enum nft_set_attributes
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_USERDATA: u16 = 13;
// enum nft_rule_attributes
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
// enum nft_set_elem_list_attributes, nft_list_attributes, nft_set_elem_attributes,
// nft_data_attributes
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_USERDATA: u16 = 6;
const NFTA_DATA_VALUE: u16 = 1;
// nftables datatype ids of set keys (`TYPE_IPADDR`, `TYPE_IP6ADDR`).
const KEY_TYPE_IPV4: u32 = 7;
const KEY_TYPE_IPV6: u32 = 8;
// libnftnl user-data TLV types.
const UDATA_SET_KEYBYTEORDER: u8 = 0;
const UDATA_SET_COMMENT: u8 = 7;
const BYTEORDER_BIG_ENDIAN: u32 = 2;

pub type Msg = NetlinkMessage<NetfilterMessage>;

fn inet(msg: NfTablesMessage) -> NetfilterMessage {
    NetfilterMessage::new(NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0), msg)
}

fn wrap(inner: NetfilterMessage, flags: u16) -> Msg {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    NetlinkMessage::new(header, NetlinkPayload::InnerMessage(inner))
}

/// A modification of the netfilter state. The kernel reports a batch message's failure whether
/// or not it asked for an ack, naming it by its sequence number; [`Batch::encode`] leaves the
/// ack on the last message only.
pub fn change(msg: NfTablesMessage, extra_flags: u16) -> Msg {
    wrap(inet(msg), NLM_F_REQUEST | NLM_F_ACK | extra_flags)
}

/// An ordered list of changes the kernel applies all together or not at all.
#[derive(Default)]
pub struct Batch {
    msgs: Vec<Msg>,
}

impl Batch {
    pub fn push(&mut self, msg: Msg) {
        self.msgs.push(msg);
    }

    pub fn len(&self) -> usize {
        self.msgs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// `add table` (creates it when absent, never fails when present).
    pub fn add_table(&mut self, name: &str) {
        self.push(change(
            NfTablesMessage::NewTable(TableMessage {
                attributes: vec![
                    TableAttribute::Name(name.to_string()),
                    TableAttribute::Flags(TableFlags::empty()),
                ],
            }),
            NLM_F_CREATE,
        ));
    }

    pub fn delete_table(&mut self, name: &str) {
        self.push(change(
            NfTablesMessage::DeleteTable(TableMessage {
                attributes: vec![TableAttribute::Name(name.to_string())],
            }),
            0,
        ));
    }

    /// Deletes `name` whether or not it exists: adding first makes the delete always valid.
    pub fn ensure_no_table(&mut self, name: &str) {
        self.add_table(name);
        self.delete_table(name);
    }

    pub fn add_chain(&mut self, table: &str, chain: &Chain) {
        let mut attributes = vec![
            ChainAttribute::Table(table.to_string()),
            ChainAttribute::Name(chain.name.clone()),
        ];
        if let Some(base) = &chain.base {
            attributes.push(ChainAttribute::Hook(vec![
                NlHook::Number(HookNumber::Inet(InetHookNumber::from(base.hook as u32))),
                NlHook::Priority(base.priority as u32),
            ]));
            attributes.push(ChainAttribute::Type(base.kind.as_str().to_string()));
        }
        self.push(change(
            NfTablesMessage::NewChain(ChainMessage { attributes }),
            NLM_F_CREATE,
        ));
    }

    /// `flush table`: a rule deletion naming only the table removes the rules of every chain in
    /// it; chains, sets and set elements stay.
    pub fn flush_table(&mut self, table: &str) {
        self.push(change(
            NfTablesMessage::DeleteRule(RuleMessage {
                attributes: vec![RuleAttribute::Table(table.to_string())],
            }),
            0,
        ));
    }

    pub fn add_rule(&mut self, table: &str, rule: &Rule) {
        self.push(change(
            NfTablesMessage::NewRule(RuleMessage {
                attributes: vec![
                    RuleAttribute::Table(table.to_string()),
                    RuleAttribute::Chain(rule.chain.clone()),
                    RuleAttribute::Expressions(rule_to_netlink(&rule.exprs)),
                ],
            }),
            NLM_F_CREATE | NLM_F_APPEND,
        ));
    }

    /// `add set` (keeps an existing set and its elements).
    pub fn add_set(&mut self, table: &str, set: &Set, id: u32) {
        let (key_type, key_len) = match set.key {
            SetKey::Ipv4Addr => (KEY_TYPE_IPV4, 4),
            SetKey::Ipv6Addr => (KEY_TYPE_IPV6, 16),
        };
        let mut udata = Vec::new();
        push_tlv(
            &mut udata,
            UDATA_SET_KEYBYTEORDER,
            &BYTEORDER_BIG_ENDIAN.to_ne_bytes(),
        );
        if let Some(c) = &set.comment {
            push_tlv(&mut udata, UDATA_SET_COMMENT, &nul_terminated(c));
        }
        self.push(change(
            NfTablesMessage::NewSet(SetMessage {
                attributes: vec![
                    SetAttribute::Table(table.to_string()),
                    SetAttribute::Name(set.name.clone()),
                    SetAttribute::Flags(SetFlags::empty()),
                    SetAttribute::KeyType(key_type),
                    SetAttribute::KeyLen(key_len),
                    SetAttribute::Id(id),
                    SetAttribute::UserData(udata),
                ],
            }),
            NLM_F_CREATE,
        ));
    }

    /// Replaces the in-pod tables with `ruleset`: every table is created, deleted and created
    /// again, so whatever was in it before (foreign chains included) is gone when the batch
    /// commits. Sets are never part of an in-pod rule set.
    pub fn replace_tables(&mut self, ruleset: &Ruleset) {
        for table in &ruleset.tables {
            self.ensure_no_table(&table.name);
            self.add_table(&table.name);
            self.add_contents(table);
        }
    }

    /// Adds chains and rules of `table` (after `add table`).
    pub fn add_contents(&mut self, table: &Table) {
        for chain in &table.chains {
            self.add_chain(&table.name, chain);
        }
        for rule in &table.rules {
            self.add_rule(&table.name, rule);
        }
    }

    /// Sends the batch and waits for every ack. On any error the kernel has applied nothing.
    pub fn commit(self, sock: &mut NetlinkSocket) -> Result<(), NetlinkError> {
        if self.msgs.is_empty() {
            return Ok(());
        }
        sock.transact_encoded(&mut self.encode())
    }

    /// The batch's bytes, begin and end included, to commit with
    /// [`NetlinkSocket::transact_encoded`] as often as wanted.
    pub fn encode(mut self) -> Encoded {
        // One ack, for the last message, says the batch is done: the kernel answers each acked
        // message with a datagram of its own, and reading a pod's forty took two system calls
        // each (the agent's most frequent call, per CNI ADD). Failures come unasked.
        if let Some((_, before)) = self.msgs.split_last_mut() {
            for msg in before {
                msg.header.flags &= !NLM_F_ACK;
            }
        }
        let mut all = Vec::with_capacity(self.msgs.len() + 2);
        all.push(control(ControlMessage::BatchBegin));
        all.extend(self.msgs);
        all.push(control(ControlMessage::BatchEnd));
        Encoded::new(&mut all)
    }
}

fn control(msg: ControlMessage) -> Msg {
    wrap(
        NetfilterMessage::new(
            NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES),
            msg,
        ),
        NLM_F_REQUEST,
    )
}

/// A dump of inet objects whose replies of type `reply` (an `NFT_MSG_*`) are returned
/// undecoded, for [`Nlas`] to read: see there why.
fn dump_raw(
    sock: &mut NetlinkSocket,
    msg: NfTablesMessage,
    reply: u16,
) -> Result<Payloads, NetlinkError> {
    dump_raw_of(sock, NetfilterProtoFamily::Inet, msg, reply)
}

/// [`dump_raw`] of the objects of `family` (`Unspec`: of every family, each reply's
/// `nfgenmsg` naming its own).
fn dump_raw_of(
    sock: &mut NetlinkSocket,
    family: NetfilterProtoFamily,
    msg: NfTablesMessage,
    reply: u16,
) -> Result<Payloads, NetlinkError> {
    let wanted = reply_type(reply);
    let request = NetfilterMessage::new(NetfilterHeader::new(family, 0, 0), msg);
    sock.dump_raw(request, |t| t == wanted)
}

/// The netlink message type of an nf_tables reply of kind `NFT_MSG_*`.
pub fn reply_type(kind: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | kind
}

/// The generation of the namespace's nftables: the kernel moves it with every commit.
pub fn generation(sock: &mut NetlinkSocket) -> Result<u32, NetlinkError> {
    let request = Raw::<NetfilterMessage>::Bytes {
        message_type: (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
        // nfgenmsg: AF_UNSPEC, NFNETLINK_V0, no resource id.
        payload: vec![0; NFGENMSG_LEN],
    };
    let answer = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN;
    for reply in sock.get(request)? {
        if let Raw::Bytes {
            message_type,
            payload,
        } = reply
            && message_type == answer
            && let Some(id) = message_attrs(&payload, "generation")?.get_u32_be(NFTA_GEN_ID)
        {
            return Ok(id);
        }
    }
    Err(NetlinkError::Decode(
        "the kernel's answer holds no nftables generation".into(),
    ))
}

/// Names of the ip and ip6 tables in the namespace: where iptables-nft keeps its rules (`nat`,
/// `mangle`, ...). One dump over every family, so the caller can tell cheaply whether running
/// the iptables tools there is worth it.
pub fn xtables_table_names(sock: &mut NetlinkSocket) -> Result<Vec<String>, NetlinkError> {
    // `nfgenmsg.nfgen_family` of each reply: NFPROTO_IPV4, NFPROTO_IPV6.
    const XTABLES_FAMILIES: [u8; 2] = [2, 10];
    let request = NfTablesMessage::GetTable(TableMessage { attributes: vec![] });
    let mut names = Vec::new();
    for (_, payload) in dump_raw_of(
        sock,
        NetfilterProtoFamily::Unspec,
        request,
        NFT_MSG_NEWTABLE,
    )?
    .iter()
    {
        if !payload
            .first()
            .is_some_and(|f| XTABLES_FAMILIES.contains(f))
        {
            continue;
        }
        if let Some(name) = message_attrs(payload, "table")?.get(NFTA_TABLE_NAME) {
            names.push(string_of(name));
        }
    }
    Ok(names)
}

/// One `NFT_MSG_NEWRULE` payload as the kernel dumps it: the rule's table and the rule, or
/// `None` when it names no table or chain. Public so the decoder can be fuzzed on its own.
pub fn decode_rule(payload: &[u8]) -> Result<Option<(&str, Rule)>, NetlinkError> {
    let attrs = message_attrs(payload, "rule")?;
    let (Some(table), Some(chain)) = (attrs.get(NFTA_RULE_TABLE), attrs.get(NFTA_RULE_CHAIN))
    else {
        return Ok(None);
    };
    let exprs = attrs
        .get(NFTA_RULE_EXPRESSIONS)
        .map(rule_from_wire)
        .unwrap_or_default();
    Ok(Some((
        str_of(table),
        Rule {
            chain: string_of(chain),
            exprs,
        },
    )))
}

/// One element of a set as the kernel dumps it: its key's bytes and its user data (libnftnl
/// TLVs: the comment), if any.
#[derive(Debug, PartialEq)]
pub struct SetElement {
    pub key: Vec<u8>,
    pub user_data: Option<Vec<u8>>,
}

/// Every element of inet set `set` in `table`, each key once. Decoded by hand
/// ([`decode_set_elements`]): the netlink crate formats the whole remaining buffer into an error
/// context at each element it parses, which made listing a probe set of 250 pods most of an agent
/// restart's CPU.
///
/// A hash set's dump can repeat elements, with no `NLM_F_DUMP_INTR` to say so: the kernel's
/// walker starts over on the new table when the set is resized under it (it shrinks shortly after
/// a large delete), and each part of a long dump skips by position, so a resize between parts
/// repeats some elements and leaves out as many others. A listing with repeats is therefore
/// taken again; after a few tries (a writer elsewhere keeps resizing), the repeats are dropped.
pub fn read_set_elements(
    sock: &mut NetlinkSocket,
    table: &str,
    set: &str,
) -> Result<Vec<SetElement>, NetlinkError> {
    let request = NfTablesMessage::GetSetElement(SetElementMessage {
        attributes: vec![
            SetElementList::Table(table.to_string()),
            SetElementList::Set(set.to_string()),
        ],
    });
    let mut tries = 0;
    loop {
        let mut out = Vec::new();
        for (_, payload) in dump_raw(sock, request.clone(), NFT_MSG_NEWSETELEM)?.iter() {
            out.extend(decode_set_elements(payload)?);
        }
        let listed = out.len();
        let mut seen = HashSet::with_capacity(listed);
        out.retain(|e| seen.insert(e.key.clone()));
        tries += 1;
        if out.len() == listed || tries == READS_WITH_REPEATS {
            return Ok(out);
        }
    }
}

/// How many listings of a set with repeated elements are taken before the repeats are dropped.
const READS_WITH_REPEATS: usize = 5;

/// One `NFT_MSG_NEWSETELEM` payload: the elements it carries. Public so the decoder can be
/// fuzzed on its own.
pub fn decode_set_elements(payload: &[u8]) -> Result<Vec<SetElement>, NetlinkError> {
    let malformed = || {
        NetlinkError::Decode(format!(
            "malformed set element message of {} bytes",
            payload.len()
        ))
    };
    let attrs = message_attrs(payload, "set element")?;
    let mut out = Vec::new();
    for (_, list) in attrs
        .iter()
        .filter(|(k, _)| *k == NFTA_SET_ELEM_LIST_ELEMENTS)
    {
        let list = Nlas::parse(list).ok_or_else(malformed)?;
        for (_, elem) in list.iter().filter(|(k, _)| *k == NFTA_LIST_ELEM) {
            let elem = Nlas::parse(elem).ok_or_else(malformed)?;
            let key = elem
                .get(NFTA_SET_ELEM_KEY)
                .map(|v| Nlas::parse(v).ok_or_else(malformed))
                .transpose()?
                .and_then(|data| data.get(NFTA_DATA_VALUE))
                .map(<[u8]>::to_vec);
            let Some(key) = key else { continue };
            let user_data = elem.get(NFTA_SET_ELEM_USERDATA).map(<[u8]>::to_vec);
            out.push(SetElement { key, user_data });
        }
    }
    Ok(out)
}

/// Reads the named inet tables (chains, sets and rules) from the kernel; absent tables are left
/// out of the result. Rules come back grouped by chain, in evaluation order. Every dump is
/// decoded by hand from the received bytes ([`Nlas`]): a restarted agent reads this back for
/// every enrolled pod, and the netlink crate's owned attribute lists cost an allocation per
/// attribute.
pub fn read_tables(sock: &mut NetlinkSocket, names: &[&str]) -> Result<Ruleset, NetlinkError> {
    decode_tables(names, |request, kind| dump_raw(sock, request, kind))
}

/// [`read_tables`] from the replies `dump(request, kind)` gives to each of its requests (`kind`:
/// the `NFT_MSG_*` of the replies kept). Apart from the socket so what the kernel dumps can be
/// fuzzed (`fuzz/`).
pub fn decode_tables(
    names: &[&str],
    mut dump: impl FnMut(NfTablesMessage, u16) -> Result<Payloads, NetlinkError>,
) -> Result<Ruleset, NetlinkError> {
    let mut tables: Vec<Table> = Vec::new();
    let request = NfTablesMessage::GetTable(TableMessage { attributes: vec![] });
    for (_, payload) in dump(request, NFT_MSG_NEWTABLE)?.iter() {
        let attrs = message_attrs(payload, "table")?;
        if let Some(name) = attrs
            .get(NFTA_TABLE_NAME)
            .map(str_of)
            .filter(|n| names.contains(n))
        {
            tables.push(Table {
                name: name.to_string(),
                flags: attrs.get_u32_be(NFTA_TABLE_FLAGS).unwrap_or(0),
                ..Table::default()
            });
        }
    }
    // Keep the caller's order so renderings are stable.
    tables.sort_by_key(|t| names.iter().position(|n| *n == t.name));
    if tables.is_empty() {
        return Ok(Ruleset { tables });
    }
    let find = |tables: &[Table], name: Option<&[u8]>| -> Option<usize> {
        let name = str_of(name?);
        tables.iter().position(|t| t.name == name)
    };

    let request = NfTablesMessage::GetChain(ChainMessage { attributes: vec![] });
    for (_, payload) in dump(request, NFT_MSG_NEWCHAIN)?.iter() {
        let attrs = message_attrs(payload, "chain")?;
        let (Some(t), Some(name)) = (
            find(&tables, attrs.get(NFTA_CHAIN_TABLE)),
            attrs.get(NFTA_CHAIN_NAME),
        ) else {
            continue;
        };
        let hook = attrs.get(NFTA_CHAIN_HOOK).and_then(Nlas::parse);
        let hook_u32 = |kind| hook.and_then(|h| h.get_u32_be(kind));
        let base = match (
            hook_u32(NFTA_HOOK_HOOKNUM),
            hook_u32(NFTA_HOOK_PRIORITY),
            attrs.get(NFTA_CHAIN_TYPE).map(str_of),
        ) {
            (Some(h), Some(p), Some(k)) => Some(BaseChain {
                // An unknown hook or type cannot be ours; render it as the closest so the
                // drift shows the chain, and comparison fails as it should.
                hook: Hook::from_number(h).unwrap_or(Hook::Forward),
                kind: ChainType::from_name(k).unwrap_or(ChainType::Filter),
                priority: p as i32,
            }),
            _ => None,
        };
        tables[t].chains.push(Chain {
            name: string_of(name),
            base,
        });
    }

    let request = NfTablesMessage::GetSet(SetMessage { attributes: vec![] });
    for (_, payload) in dump(request, NFT_MSG_NEWSET)?.iter() {
        let attrs = message_attrs(payload, "set")?;
        let key = match attrs.get_u32_be(NFTA_SET_KEY_TYPE) {
            Some(KEY_TYPE_IPV4) => SetKey::Ipv4Addr,
            Some(KEY_TYPE_IPV6) => SetKey::Ipv6Addr,
            _ => continue,
        };
        let (Some(t), Some(name)) = (
            find(&tables, attrs.get(NFTA_SET_TABLE)),
            attrs.get(NFTA_SET_NAME),
        ) else {
            continue;
        };
        let comment = attrs
            .get(NFTA_SET_USERDATA)
            .and_then(|u| find_tlv(u, UDATA_SET_COMMENT))
            .map(string_of);
        tables[t].sets.push(Set {
            name: string_of(name),
            key,
            comment,
        });
    }

    let request = NfTablesMessage::GetRule(RuleMessage { attributes: vec![] });
    for (_, payload) in dump(request, NFT_MSG_NEWRULE)?.iter() {
        if let Some((table, rule)) = decode_rule(payload)?
            && let Some(t) = tables.iter_mut().find(|t| t.name == table)
        {
            t.rules.push(rule);
        }
    }
    Ok(Ruleset { tables })
}

/// The attributes of one nf_tables message (after its `nfgenmsg`), or an error naming `what`.
fn message_attrs<'a>(payload: &'a [u8], what: &str) -> Result<Nlas<'a>, NetlinkError> {
    payload
        .get(NFGENMSG_LEN..)
        .and_then(Nlas::parse)
        .ok_or_else(|| {
            NetlinkError::Decode(format!(
                "malformed {what} message of {} bytes",
                payload.len()
            ))
        })
}

/// Whether the ipset `name` exists in the socket's namespace, asked over nfnetlink's ipset
/// subsystem (`IPSET_CMD_HEADER`, as `ipset list -t` asks) instead of running the `ipset` tool.
/// `None` when the kernel's answer is neither the set's header nor `ENOENT`: the caller then
/// asks the tool.
pub fn ipset_exists(sock: &mut NetlinkSocket, name: &str) -> Option<bool> {
    // From <linux/netfilter/nfnetlink.h> and <linux/netfilter/ipset/ip_set.h>.
    const NFNL_SUBSYS_IPSET: u16 = 6;
    const IPSET_CMD_HEADER: u16 = 12;
    const IPSET_ATTR_PROTOCOL: u16 = 1;
    const IPSET_ATTR_SETNAME: u16 = 2;
    /// The oldest protocol every kernel since 3.x accepts for this command.
    const IPSET_PROTOCOL_MIN: u8 = 6;
    fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
        out.extend_from_slice(&(4 + value.len() as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        out.resize(out.len().next_multiple_of(4), 0);
    }
    // nfgenmsg: family, version (NFNETLINK_V0), resource id.
    let mut payload = vec![libc::AF_INET as u8, 0, 0, 0];
    attr(&mut payload, IPSET_ATTR_PROTOCOL, &[IPSET_PROTOCOL_MIN]);
    attr(&mut payload, IPSET_ATTR_SETNAME, &nul_terminated(name));
    let request = Raw::<NetfilterMessage>::Bytes {
        message_type: (NFNL_SUBSYS_IPSET << 8) | IPSET_CMD_HEADER,
        payload,
    };
    match sock.request(request, 0) {
        Ok(()) => Some(true),
        Err(e) if e.errno() == Some(libc::ENOENT) => Some(false),
        Err(_) => None,
    }
}
