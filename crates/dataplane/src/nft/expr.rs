//! Rule expressions between our model and the kernel's register machine.
//!
//! Each model [`Expr`] expands to a fixed sequence of kernel expressions ([`Low`]) — the same
//! sequence `nft` generates, so `nft list ruleset` prints our rules in its usual syntax — and
//! [`decode`] folds such sequences back. Anything it does not recognise becomes
//! [`Expr::Unknown`] with a readable description, so foreign rules still show up in a drift.
//!
//! Expressions the netlink crate has no type for (ct, counter, redir, nat) travel as
//! `Expressions::Other` with attributes numbered as in `<linux/netfilter/nf_tables.h>`.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use cni_core::redirect::nft::{
    AddrField, CmpOp, Expr, IfField, L4Proto, PortField, Prefix, Verdict,
};
use netlink_packet_core::DefaultNla;

use smallvec::smallvec;

use super::bytes::{str_of, string_of};
use crate::netlink::Nlas;
use netlink_packet_netfilter::nftables::{
    Bitwise, Cmp, DataAttribute, ExpressionAttribute, Expressions, Immediate, ListAttribute,
    Lookup, Meta, MetaKey, Operator, Payload, Register, VerdictAttribute,
};

// enum nft_meta_keys
const META_MARK: u32 = 3;
const META_IIFNAME: u32 = 6;
const META_OIFNAME: u32 = 7;
const META_SKUID: u32 = 10;
const META_SKGID: u32 = 11;
const META_NFPROTO: u32 = 15;
const META_L4PROTO: u32 = 16;
// enum nft_ct_keys
const CT_STATE: u32 = 0;
const CT_MARK: u32 = 3;
const CT_ZONE: u32 = 17;
// enum nft_ct_attributes
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFTA_CT_SREG: u16 = 4;
// enum nft_payload_bases
const PAYLOAD_NETWORK: u32 = 1;
const PAYLOAD_TRANSPORT: u32 = 2;
// enum nft_redir_attributes
const NFTA_REDIR_REG_PROTO_MIN: u16 = 1;
const NFTA_REDIR_FLAGS: u16 = 3;
/// NF_NAT_RANGE_PROTO_SPECIFIED: the redirect carries a port.
const NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
// enum nft_tproxy_attributes
const NFTA_TPROXY_FAMILY: u16 = 1;
const NFTA_TPROXY_REG_PORT: u16 = 3;
// enum nft_nat_attributes / nft_nat_types
const NFTA_NAT_TYPE: u16 = 1;
const NFTA_NAT_FAMILY: u16 = 2;
const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
const NAT_SNAT: u32 = 0;
// NFPROTO_*
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
// Netfilter verdict codes.
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
const NFT_JUMP: u32 = -3i32 as u32;
const NFT_RETURN: u32 = -5i32 as u32;
const IFNAMSIZ: usize = 16;

/// A register's worth of data, held inline: no value of these expressions is longer than an
/// IPv6 address or an interface name (16 bytes), and a rule read back decodes several, so
/// inline storage saves an allocation each. A longer value (a foreign rule) spills to the heap.
pub(crate) type Bytes = smallvec::SmallVec<[u8; 16]>;

/// Every expression loads into and reads from register 1, as `nft` does for these rules.
const REG: u32 = 1;

/// One kernel expression, in the shape this module needs to build and recognise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Low {
    MetaLoad {
        key: u32,
    },
    MetaSet {
        key: u32,
    },
    Cmp {
        op: CmpOp,
        data: Bytes,
    },
    Payload {
        base: u32,
        offset: u32,
        len: u32,
    },
    Bitwise {
        mask: Bytes,
        xor: Bytes,
    },
    Lookup {
        set: String,
    },
    Immediate {
        data: Bytes,
    },
    Verdict {
        code: u32,
        chain: Option<String>,
    },
    Counter,
    CtLoad {
        key: u32,
    },
    CtSet {
        key: u32,
    },
    Redir,
    Snat {
        family: u8,
    },
    /// Transparent proxy to the port in the register.
    Tproxy {
        family: u8,
    },
    /// Anything else, by name and raw attributes; only ever decoded, never built.
    Other {
        name: String,
        detail: String,
    },
}

impl fmt::Display for Low {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Low::MetaLoad { key } => write!(f, "[meta load {key}]"),
            Low::MetaSet { key } => write!(f, "[meta set {key}]"),
            Low::Cmp { op, data } => write!(f, "[cmp {op} {}]", hex(data)),
            Low::Payload { base, offset, len } => {
                write!(f, "[payload load {len}b @ base {base} + {offset}]")
            }
            Low::Bitwise { mask, xor } => {
                write!(f, "[bitwise & {} ^ {}]", hex(mask), hex(xor))
            }
            Low::Lookup { set } => write!(f, "[lookup @{set}]"),
            Low::Immediate { data } => write!(f, "[immediate {}]", hex(data)),
            Low::Verdict { code, chain } => match chain {
                Some(c) => write!(f, "[verdict {} {c}]", *code as i32),
                None => write!(f, "[verdict {}]", *code as i32),
            },
            Low::Counter => f.write_str("[counter]"),
            Low::CtLoad { key } => write!(f, "[ct load {key}]"),
            Low::CtSet { key } => write!(f, "[ct set {key}]"),
            Low::Redir => f.write_str("[redir]"),
            Low::Snat { family } => write!(f, "[snat family {family}]"),
            Low::Tproxy { family } => write!(f, "[tproxy family {family}]"),
            Low::Other { name, detail } => write!(f, "[{name}{detail}]"),
        }
    }
}

fn hex(data: &[u8]) -> String {
    let mut s = String::from("0x");
    for b in data {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn addr_bytes(addr: IpAddr) -> Bytes {
    match addr {
        IpAddr::V4(a) => Bytes::from_slice(&a.octets()),
        IpAddr::V6(a) => Bytes::from_slice(&a.octets()),
    }
}

fn prefix_mask(len: u8, total_bytes: usize) -> Bytes {
    (0..total_bytes)
        .map(|i| {
            let bits = (len as usize).saturating_sub(i * 8).min(8);
            if bits == 0 { 0 } else { 0xffu8 << (8 - bits) }
        })
        .collect()
}

fn nfproto_match(v6: bool) -> [Low; 2] {
    [
        Low::MetaLoad { key: META_NFPROTO },
        Low::Cmp {
            op: CmpOp::Eq,
            data: smallvec![if v6 { NFPROTO_IPV6 } else { NFPROTO_IPV4 }],
        },
    ]
}

fn addr_payload(field: AddrField, v6: bool) -> Low {
    let (offset, len) = match (v6, field) {
        (false, AddrField::Saddr) => (12, 4),
        (false, AddrField::Daddr) => (16, 4),
        (true, AddrField::Saddr) => (8, 16),
        (true, AddrField::Daddr) => (24, 16),
    };
    Low::Payload {
        base: PAYLOAD_NETWORK,
        offset,
        len,
    }
}

fn masked(mask: u32) -> Low {
    // Packet and connection marks are host-order integers in nftables registers.
    Low::Bitwise {
        mask: mask.to_ne_bytes().as_slice().into(),
        xor: smallvec![0; 4],
    }
}

/// The kernel expressions of one model expression.
pub(crate) fn encode(expr: &Expr) -> Vec<Low> {
    match expr {
        Expr::L4Proto(p) => vec![
            Low::MetaLoad { key: META_L4PROTO },
            Low::Cmp {
                op: CmpOp::Eq,
                data: smallvec![p.number()],
            },
        ],
        Expr::Addr { field, op, prefix } => {
            let v6 = prefix.addr.is_ipv6();
            let mut out = nfproto_match(v6).to_vec();
            out.push(addr_payload(*field, v6));
            let bytes = addr_bytes(prefix.addr);
            let mut data = bytes.clone();
            if prefix.len < Prefix::max_len(prefix.addr) {
                let mask = prefix_mask(prefix.len, bytes.len());
                data = bytes.iter().zip(&mask).map(|(b, m)| b & m).collect();
                out.push(Low::Bitwise {
                    xor: smallvec![0; mask.len()],
                    mask,
                });
            }
            out.push(Low::Cmp { op: *op, data });
            out
        }
        Expr::Port {
            proto,
            field,
            op,
            port,
        } => vec![
            Low::MetaLoad { key: META_L4PROTO },
            Low::Cmp {
                op: CmpOp::Eq,
                data: smallvec![proto.number()],
            },
            Low::Payload {
                base: PAYLOAD_TRANSPORT,
                offset: match field {
                    PortField::Sport => 0,
                    PortField::Dport => 2,
                },
                len: 2,
            },
            Low::Cmp {
                op: *op,
                data: port.to_be_bytes().as_slice().into(),
            },
        ],
        Expr::Iface { field, op, name } => {
            let mut data = Bytes::from_slice(name.as_bytes());
            data.resize(IFNAMSIZ, 0);
            vec![
                Low::MetaLoad {
                    key: match field {
                        IfField::Iifname => META_IIFNAME,
                        IfField::Oifname => META_OIFNAME,
                    },
                },
                Low::Cmp { op: *op, data },
            ]
        }
        Expr::Mark {
            mask: u32::MAX,
            op,
            value,
        } => vec![
            Low::MetaLoad { key: META_MARK },
            Low::Cmp {
                op: *op,
                data: value.to_ne_bytes().as_slice().into(),
            },
        ],
        Expr::Mark { mask, op, value } => vec![
            Low::MetaLoad { key: META_MARK },
            masked(*mask),
            Low::Cmp {
                op: *op,
                data: value.to_ne_bytes().as_slice().into(),
            },
        ],
        Expr::CtMark {
            mask: u32::MAX,
            op,
            value,
        } => vec![
            Low::CtLoad { key: CT_MARK },
            Low::Cmp {
                op: *op,
                data: value.to_ne_bytes().as_slice().into(),
            },
        ],
        Expr::CtMark { mask, op, value } => vec![
            Low::CtLoad { key: CT_MARK },
            masked(*mask),
            Low::Cmp {
                op: *op,
                data: value.to_ne_bytes().as_slice().into(),
            },
        ],
        Expr::Owner { gid, op, id } => vec![
            Low::MetaLoad {
                key: if *gid { META_SKGID } else { META_SKUID },
            },
            Low::Cmp {
                op: *op,
                data: id.to_ne_bytes().as_slice().into(),
            },
        ],
        Expr::AddrInSet { field, v6, set } => {
            let mut out = nfproto_match(*v6).to_vec();
            out.push(addr_payload(*field, *v6));
            out.push(Low::Lookup { set: set.clone() });
            out
        }
        Expr::Counter => vec![Low::Counter],
        Expr::Verdict(v) => vec![match v {
            Verdict::Accept => Low::Verdict {
                code: NF_ACCEPT,
                chain: None,
            },
            Verdict::Drop => Low::Verdict {
                code: NF_DROP,
                chain: None,
            },
            Verdict::Return => Low::Verdict {
                code: NFT_RETURN,
                chain: None,
            },
            Verdict::Jump(c) => Low::Verdict {
                code: NFT_JUMP,
                chain: Some(c.clone()),
            },
        }],
        Expr::Redirect { port } => vec![
            Low::Immediate {
                data: port.to_be_bytes().as_slice().into(),
            },
            Low::Redir,
        ],
        Expr::Snat { addr } => vec![
            Low::Immediate {
                data: addr_bytes(*addr),
            },
            Low::Snat {
                family: if addr.is_ipv4() {
                    NFPROTO_IPV4
                } else {
                    NFPROTO_IPV6
                },
            },
        ],
        Expr::CtMarkSetMasked { keep, or } => vec![
            Low::CtLoad { key: CT_MARK },
            Low::Bitwise {
                mask: keep.to_ne_bytes().as_slice().into(),
                xor: or.to_ne_bytes().as_slice().into(),
            },
            Low::CtSet { key: CT_MARK },
        ],
        Expr::MarkSetCtMark => vec![
            Low::CtLoad { key: CT_MARK },
            Low::MetaSet { key: META_MARK },
        ],
        Expr::CtZoneSet(zone) => vec![
            Low::Immediate {
                data: zone.to_ne_bytes().as_slice().into(),
            },
            Low::CtSet { key: CT_ZONE },
        ],
        Expr::MarkSet(mark) => vec![
            Low::Immediate {
                data: mark.to_ne_bytes().as_slice().into(),
            },
            Low::MetaSet { key: META_MARK },
        ],
        Expr::CtMarkSetMark => vec![
            Low::MetaLoad { key: META_MARK },
            Low::CtSet { key: CT_MARK },
        ],
        Expr::CtState(bits) => vec![
            Low::CtLoad { key: CT_STATE },
            masked(*bits),
            Low::Cmp {
                op: CmpOp::Ne,
                data: smallvec![0; 4],
            },
        ],
        Expr::Tproxy { v6, port } => vec![
            Low::Immediate {
                data: port.to_be_bytes().as_slice().into(),
            },
            Low::Tproxy {
                family: if *v6 { NFPROTO_IPV6 } else { NFPROTO_IPV4 },
            },
        ],
        // Never built: an unknown expression only exists in state read back from the kernel.
        Expr::Unknown(_) => vec![],
    }
}

fn u32_ne(data: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(data.try_into().ok()?))
}

fn ip_from(data: &[u8]) -> Option<IpAddr> {
    match data.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(data).ok()?))),
        16 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(data).ok()?))),
        _ => None,
    }
}

fn prefix_len_of(mask: &[u8]) -> Option<u8> {
    let ones: u32 = mask.iter().map(|b| b.count_ones()).sum();
    (prefix_mask(ones as u8, mask.len()).as_slice() == mask).then_some(ones as u8)
}

/// Folds kernel expressions back into model expressions (the inverse of [`encode`]).
pub(crate) fn decode(lows: &[Low]) -> Vec<Expr> {
    // Never more expressions than kernel expressions: one allocation, never grown.
    let mut out = Vec::with_capacity(lows.len());
    let mut i = 0;
    while i < lows.len() {
        match decode_one(&lows[i..]) {
            Some((expr, used)) => {
                out.push(expr);
                i += used;
            }
            None => {
                out.push(Expr::Unknown(lows[i].to_string()));
                i += 1;
            }
        }
    }
    out
}

fn decode_one(l: &[Low]) -> Option<(Expr, usize)> {
    let eq = CmpOp::Eq;
    Some(match l {
        [
            Low::MetaLoad { key: META_NFPROTO },
            Low::Cmp { op, data: fam },
            Low::Payload {
                base: PAYLOAD_NETWORK,
                offset,
                len,
            },
            rest @ ..,
        ] if *op == eq && fam.len() == 1 => {
            let v6 = fam[0] == NFPROTO_IPV6;
            let field = match (v6, offset, len) {
                (false, 12, 4) | (true, 8, 16) => AddrField::Saddr,
                (false, 16, 4) | (true, 24, 16) => AddrField::Daddr,
                _ => return None,
            };
            match rest {
                [Low::Lookup { set }, ..] => (
                    Expr::AddrInSet {
                        field,
                        v6,
                        set: set.clone(),
                    },
                    4,
                ),
                [Low::Bitwise { mask, xor }, Low::Cmp { op, data }, ..]
                    if xor.iter().all(|b| *b == 0) && mask.len() == *len as usize =>
                {
                    let addr = ip_from(data)?;
                    let prefix = Prefix {
                        addr,
                        len: prefix_len_of(mask)?,
                    };
                    (
                        Expr::Addr {
                            field,
                            op: *op,
                            prefix,
                        },
                        5,
                    )
                }
                [Low::Cmp { op, data }, ..] => (
                    Expr::Addr {
                        field,
                        op: *op,
                        prefix: Prefix::host(ip_from(data)?),
                    },
                    4,
                ),
                _ => return None,
            }
        }
        [
            Low::MetaLoad { key: META_L4PROTO },
            Low::Cmp { op, data: p },
            rest @ ..,
        ] if *op == eq && p.len() == 1 => {
            let proto = L4Proto::from_number(p[0])?;
            match rest {
                [
                    Low::Payload {
                        base: PAYLOAD_TRANSPORT,
                        offset: off @ (0 | 2),
                        len: 2,
                    },
                    Low::Cmp { op, data },
                    ..,
                ] if data.len() == 2 => (
                    Expr::Port {
                        proto,
                        field: if *off == 0 {
                            PortField::Sport
                        } else {
                            PortField::Dport
                        },
                        op: *op,
                        port: u16::from_be_bytes([data[0], data[1]]),
                    },
                    4,
                ),
                _ => (Expr::L4Proto(proto), 2),
            }
        }
        [
            Low::MetaLoad {
                key: k @ (META_IIFNAME | META_OIFNAME),
            },
            Low::Cmp { op, data },
            ..,
        ] if data.len() == IFNAMSIZ && data.contains(&0) => {
            let end = data.iter().position(|b| *b == 0)?;
            let name = String::from_utf8(data[..end].to_vec()).ok()?;
            let field = if *k == META_IIFNAME {
                IfField::Iifname
            } else {
                IfField::Oifname
            };
            (
                Expr::Iface {
                    field,
                    op: *op,
                    name,
                },
                2,
            )
        }
        [
            Low::MetaLoad { key: META_MARK },
            Low::CtSet { key: CT_MARK },
            ..,
        ] => (Expr::CtMarkSetMark, 2),
        [Low::MetaLoad { key: META_MARK }, Low::Cmp { op, data }, ..] => (
            Expr::Mark {
                mask: u32::MAX,
                op: *op,
                value: u32_ne(data)?,
            },
            2,
        ),
        [Low::CtLoad { key: CT_MARK }, Low::Cmp { op, data }, ..] => (
            Expr::CtMark {
                mask: u32::MAX,
                op: *op,
                value: u32_ne(data)?,
            },
            2,
        ),
        [
            Low::CtLoad { key: CT_STATE },
            Low::Bitwise { mask, xor },
            Low::Cmp {
                op: CmpOp::Ne,
                data,
            },
            ..,
        ] if xor.iter().all(|b| *b == 0) && data.iter().all(|b| *b == 0) => {
            (Expr::CtState(u32_ne(mask)?), 3)
        }
        [Low::Immediate { data }, Low::MetaSet { key: META_MARK }, ..] => {
            (Expr::MarkSet(u32_ne(data)?), 2)
        }
        [Low::Immediate { data }, Low::Tproxy { family }, ..] if data.len() == 2 => (
            Expr::Tproxy {
                v6: *family == NFPROTO_IPV6,
                port: u16::from_be_bytes([data[0], data[1]]),
            },
            2,
        ),
        [
            Low::MetaLoad { key: META_MARK },
            Low::Bitwise { mask, xor },
            Low::Cmp { op, data },
            ..,
        ] if xor.iter().all(|b| *b == 0) => {
            let (mask, value) = (u32_ne(mask)?, u32_ne(data)?);
            (
                Expr::Mark {
                    mask,
                    op: *op,
                    value,
                },
                3,
            )
        }
        [
            Low::MetaLoad {
                key: k @ (META_SKUID | META_SKGID),
            },
            Low::Cmp { op, data },
            ..,
        ] => (
            Expr::Owner {
                gid: *k == META_SKGID,
                op: *op,
                id: u32_ne(data)?,
            },
            2,
        ),
        [
            Low::CtLoad { key: CT_MARK },
            Low::MetaSet { key: META_MARK },
            ..,
        ] => (Expr::MarkSetCtMark, 2),
        [
            Low::CtLoad { key: CT_MARK },
            Low::Bitwise { mask, xor },
            Low::CtSet { key: CT_MARK },
            ..,
        ] => (
            Expr::CtMarkSetMasked {
                keep: u32_ne(mask)?,
                or: u32_ne(xor)?,
            },
            3,
        ),
        [
            Low::CtLoad { key: CT_MARK },
            Low::Bitwise { mask, xor },
            Low::Cmp { op, data },
            ..,
        ] if xor.iter().all(|b| *b == 0) => {
            let (mask, value) = (u32_ne(mask)?, u32_ne(data)?);
            (
                Expr::CtMark {
                    mask,
                    op: *op,
                    value,
                },
                3,
            )
        }
        [Low::Counter, ..] => (Expr::Counter, 1),
        [Low::Verdict { code, chain }, ..] => {
            let v = match (*code, chain) {
                (NF_ACCEPT, None) => cni_core::redirect::nft::Verdict::Accept,
                (NF_DROP, None) => cni_core::redirect::nft::Verdict::Drop,
                (NFT_RETURN, None) => cni_core::redirect::nft::Verdict::Return,
                (NFT_JUMP, Some(c)) => cni_core::redirect::nft::Verdict::Jump(c.clone()),
                _ => return None,
            };
            (Expr::Verdict(v), 1)
        }
        [Low::Immediate { data }, Low::Redir, ..] if data.len() == 2 => (
            Expr::Redirect {
                port: u16::from_be_bytes([data[0], data[1]]),
            },
            2,
        ),
        [Low::Immediate { data }, Low::Snat { .. }, ..] => (
            Expr::Snat {
                addr: ip_from(data)?,
            },
            2,
        ),
        [Low::Immediate { data }, Low::CtSet { key: CT_ZONE }, ..] if data.len() == 2 => {
            (Expr::CtZoneSet(u16::from_ne_bytes([data[0], data[1]])), 2)
        }
        _ => return None,
    })
}

fn reg() -> Register {
    Register::from(REG)
}

fn value(data: &[u8]) -> DataAttribute {
    DataAttribute::Value(data.to_vec())
}

fn op_to_nl(op: CmpOp) -> Operator {
    match op {
        CmpOp::Eq => Operator::Equal,
        CmpOp::Ne => Operator::NotEqual,
    }
}

fn be32(kind: u16, v: u32) -> DefaultNla {
    DefaultNla::new(kind, v.to_be_bytes().to_vec())
}

fn other(name: &str, attributes: Vec<DefaultNla>) -> Expressions {
    Expressions::Other {
        expression_type: name.to_string(),
        attributes,
    }
}

/// One kernel expression as a netlink list element.
pub(crate) fn to_netlink(low: &Low) -> ListAttribute<ExpressionAttribute> {
    let e = match low {
        Low::MetaLoad { key } => Expressions::Meta(vec![
            Meta::Key(MetaKey::from(*key)),
            Meta::DestinationRegister(reg()),
        ]),
        Low::MetaSet { key } => Expressions::Meta(vec![
            Meta::Key(MetaKey::from(*key)),
            Meta::SourceRegister(reg()),
        ]),
        Low::Cmp { op, data } => Expressions::Cmp(vec![
            Cmp::SourceRegister(reg()),
            Cmp::Op(op_to_nl(*op)),
            Cmp::Data(value(data)),
        ]),
        Low::Payload { base, offset, len } => Expressions::Payload(vec![
            Payload::DestinationRegister(reg()),
            Payload::Base(*base),
            Payload::Offset(*offset),
            Payload::Len(*len),
        ]),
        Low::Bitwise { mask, xor } => Expressions::Bitwise(vec![
            Bitwise::SourceRegister(reg()),
            Bitwise::DestinationRegister(reg()),
            Bitwise::Length(mask.len() as u32),
            Bitwise::Mask(value(mask)),
            Bitwise::Xor(value(xor)),
        ]),
        Low::Lookup { set } => Expressions::Lookup(vec![
            Lookup::Set(set.clone()),
            Lookup::SourceRegister(reg()),
        ]),
        Low::Immediate { data } => Expressions::Immediate(vec![
            Immediate::DestinationRegister(reg()),
            Immediate::Data(value(data)),
        ]),
        Low::Verdict { code, chain } => {
            let mut v = vec![VerdictAttribute::Code((*code).into())];
            if let Some(c) = chain {
                v.push(VerdictAttribute::Chain(c.clone()));
            }
            Expressions::Immediate(vec![
                Immediate::DestinationRegister(Register::Verdict),
                Immediate::Data(DataAttribute::Verdict(v)),
            ])
        }
        Low::Counter => other("counter", vec![]),
        Low::CtLoad { key } => other("ct", vec![be32(NFTA_CT_KEY, *key), be32(NFTA_CT_DREG, REG)]),
        Low::CtSet { key } => other("ct", vec![be32(NFTA_CT_KEY, *key), be32(NFTA_CT_SREG, REG)]),
        Low::Redir => other(
            "redir",
            vec![
                be32(NFTA_REDIR_REG_PROTO_MIN, REG),
                be32(NFTA_REDIR_FLAGS, NAT_RANGE_PROTO_SPECIFIED),
            ],
        ),
        Low::Snat { family } => other(
            "nat",
            vec![
                be32(NFTA_NAT_TYPE, NAT_SNAT),
                be32(NFTA_NAT_FAMILY, u32::from(*family)),
                be32(NFTA_NAT_REG_ADDR_MIN, REG),
            ],
        ),
        Low::Tproxy { family } => other(
            "tproxy",
            vec![
                be32(NFTA_TPROXY_FAMILY, u32::from(*family)),
                be32(NFTA_TPROXY_REG_PORT, REG),
            ],
        ),
        // Never built (see `encode`); an empty counter keeps the function total.
        Low::Other { .. } => other("counter", vec![]),
    };
    ListAttribute::from(e)
}

// enum nft_list_attributes, nft_expr_attributes, nft_data_attributes, nft_verdict_attributes
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
// Per-expression attributes.
const NFTA_META_KEY: u16 = 2;
const NFTA_META_SREG: u16 = 3;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_LOOKUP_SET: u16 = 1;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
// enum nft_cmp_ops
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
/// `NFT_REG_VERDICT`: an immediate loaded here is a verdict.
const NFT_REG_VERDICT: u32 = 0;

/// The `NFTA_DATA_VALUE` inside a nested data attribute.
fn data_value(nested: &[u8]) -> Option<Bytes> {
    Nlas::parse(nested)?
        .get(NFTA_DATA_VALUE)
        .map(Bytes::from_slice)
}

/// One expression's `NFTA_EXPR_DATA` attributes back into a kernel expression.
fn low_from_attrs(name: &str, a: Nlas<'_>) -> Option<Low> {
    let has = |kind: u16| a.get(kind).is_some();
    Some(match name {
        "meta" => {
            let key = a.get_u32_be(NFTA_META_KEY)?;
            if has(NFTA_META_SREG) {
                Low::MetaSet { key }
            } else {
                Low::MetaLoad { key }
            }
        }
        "cmp" => Low::Cmp {
            op: match a.get_u32_be(NFTA_CMP_OP)? {
                NFT_CMP_EQ => CmpOp::Eq,
                NFT_CMP_NEQ => CmpOp::Ne,
                _ => return None,
            },
            data: data_value(a.get(NFTA_CMP_DATA)?)?,
        },
        "payload" if has(NFTA_PAYLOAD_DREG) => Low::Payload {
            base: a.get_u32_be(NFTA_PAYLOAD_BASE)?,
            offset: a.get_u32_be(NFTA_PAYLOAD_OFFSET)?,
            len: a.get_u32_be(NFTA_PAYLOAD_LEN)?,
        },
        "bitwise" => Low::Bitwise {
            mask: data_value(a.get(NFTA_BITWISE_MASK)?)?,
            xor: data_value(a.get(NFTA_BITWISE_XOR)?)?,
        },
        "lookup" => Low::Lookup {
            set: string_of(a.get(NFTA_LOOKUP_SET)?),
        },
        "immediate" => {
            let data = Nlas::parse(a.get(NFTA_IMMEDIATE_DATA)?)?;
            if a.get_u32_be(NFTA_IMMEDIATE_DREG)? == NFT_REG_VERDICT {
                let v = Nlas::parse(data.get(NFTA_DATA_VERDICT)?)?;
                Low::Verdict {
                    code: v.get_u32_be(NFTA_VERDICT_CODE)?,
                    chain: v.get(NFTA_VERDICT_CHAIN).map(string_of),
                }
            } else {
                Low::Immediate {
                    data: Bytes::from_slice(data.get(NFTA_DATA_VALUE)?),
                }
            }
        }
        "counter" => Low::Counter,
        "ct" => match (
            a.get_u32_be(NFTA_CT_KEY)?,
            has(NFTA_CT_DREG),
            has(NFTA_CT_SREG),
        ) {
            (key, true, false) => Low::CtLoad { key },
            (key, false, true) => Low::CtSet { key },
            _ => return None,
        },
        "redir" if has(NFTA_REDIR_REG_PROTO_MIN) => Low::Redir,
        "tproxy" if has(NFTA_TPROXY_REG_PORT) => Low::Tproxy {
            family: a.get_u32_be(NFTA_TPROXY_FAMILY)? as u8,
        },
        "nat" if a.get_u32_be(NFTA_NAT_TYPE)? == NAT_SNAT => Low::Snat {
            family: a.get_u32_be(NFTA_NAT_FAMILY)? as u8,
        },
        _ => return None,
    })
}

/// One `NFTA_LIST_ELEM` of a rule back into a kernel expression; anything unrecognised (or
/// malformed) becomes [`Low::Other`], so it shows up in a drift instead of vanishing.
fn low_from_elem(elem: &[u8]) -> Low {
    let attrs = Nlas::parse(elem).unwrap_or_default();
    // Borrowed: the name is only matched on, and kept only for an expression not understood.
    let name = attrs.get(NFTA_EXPR_NAME).map_or("?", str_of);
    attrs
        .get(NFTA_EXPR_DATA)
        .and_then(Nlas::parse)
        .and_then(|data| low_from_attrs(name, data))
        .unwrap_or_else(|| Low::Other {
            name: name.to_string(),
            detail: String::new(),
        })
}

/// A rule's model expressions as the netlink list the kernel expects.
pub(crate) fn rule_to_netlink(exprs: &[Expr]) -> Vec<ListAttribute<ExpressionAttribute>> {
    exprs
        .iter()
        .flat_map(encode)
        .map(|l| to_netlink(&l))
        .collect()
}

/// The kernel's expression list of a rule (`NFTA_RULE_EXPRESSIONS`), folded into model
/// expressions.
pub(crate) fn rule_from_wire(list: &[u8]) -> Vec<Expr> {
    let lows: Vec<Low> = match Nlas::parse(list) {
        Some(items) => {
            // Sized first: the walk cannot tell its length, and growing would reallocate.
            let mut lows = Vec::with_capacity(items.iter().count());
            lows.extend(items.iter().map(|(kind, value)| match kind {
                NFTA_LIST_ELEM => low_from_elem(value),
                other => Low::Other {
                    name: format!("list attribute {other}"),
                    detail: String::new(),
                },
            }));
            lows
        }
        None => vec![Low::Other {
            name: "malformed expression list".into(),
            detail: String::new(),
        }],
    };
    decode(&lows)
}

#[cfg(test)]
mod tests {
    use cni_core::redirect::ambient::InpodConfig;
    use cni_core::redirect::ambient::nft::{HostProbeConfig, host_ruleset, inpod_ruleset};
    use netlink_packet_core::Emitable;
    use netlink_packet_netfilter::nftables::RuleAttribute;

    use super::*;

    fn all_rules() -> Vec<Vec<Expr>> {
        let cfg = InpodConfig {
            ipv6: true,
            reroute_virtual_interfaces: vec![
                cni_core::redirect::InterfaceName::new("eth9").unwrap(),
            ],
            ..InpodConfig::default()
        };
        let host = HostProbeConfig {
            kubelet_uid: 1000,
            ipv6: true,
            probe_snat_v4: cni_core::redirect::ambient::consts::PROBE_SNAT_V4,
            probe_snat_v6: cni_core::redirect::ambient::consts::PROBE_SNAT_V6,
        };
        // Sidecar TPROXY + DNS + drop-invalid, dual stack: every sidecar expression at once.
        let sidecar = cni_core::redirect::sidecar::SidecarConfig {
            mode: cni_core::redirect::sidecar::InterceptionMode::Tproxy,
            redirect_dns: true,
            drop_invalid: true,
            ipv6: true,
            ..Default::default()
        };
        inpod_ruleset(&cfg)
            .tables
            .into_iter()
            .chain(host_ruleset(&host).tables)
            .chain(cni_core::redirect::sidecar::nft::ruleset(&sidecar).tables)
            .flat_map(|t| t.rules)
            .map(|r| r.exprs)
            .collect()
    }

    /// Every rule we build survives model → kernel expressions → model.
    #[test]
    fn model_round_trips_through_kernel_expressions() {
        for exprs in all_rules() {
            let lows: Vec<Low> = exprs.iter().flat_map(encode).collect();
            assert_eq!(decode(&lows), exprs);
        }
    }

    /// ... and through the netlink wire format, bytes included.
    #[test]
    fn model_round_trips_through_netlink_bytes() {
        use netlink_packet_core::NlaBuffer;
        for exprs in all_rules() {
            let attr = RuleAttribute::Expressions(rule_to_netlink(&exprs));
            let mut buf = vec![0; attr.buffer_len()];
            attr.emit(&mut buf);
            let nla = NlaBuffer::new(&buf);
            assert_eq!(rule_from_wire(nla.value()), exprs);
        }
    }

    #[test]
    fn prefixes_are_masked() {
        let e = Expr::Addr {
            field: AddrField::Daddr,
            op: CmpOp::Eq,
            prefix: Prefix {
                addr: "10.1.2.3".parse().unwrap(),
                len: 12,
            },
        };
        let lows = encode(&e);
        assert!(lows.contains(&Low::Bitwise {
            mask: smallvec![255, 240, 0, 0],
            xor: smallvec![0; 4]
        }));
        assert!(lows.contains(&Low::Cmp {
            op: CmpOp::Eq,
            data: smallvec![10, 0, 0, 0]
        }));
        match &decode(&lows)[..] {
            [Expr::Addr { prefix, .. }] => assert_eq!(prefix.len, 12),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unrecognised_sequences_stay_readable() {
        let lows = vec![Low::MetaLoad { key: 99 }, Low::Counter];
        let exprs = decode(&lows);
        assert_eq!(exprs[0], Expr::Unknown("[meta load 99]".to_string()));
        assert_eq!(exprs[1], Expr::Counter);
    }
}
