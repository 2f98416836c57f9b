//! A small synchronous netlink socket shared by every netlink family we speak (rtnetlink for
//! routes and rules, nfnetlink for nftables batches).
//!
//! The socket belongs to the network namespace it was *created* in, so callers create it inside
//! a pod namespace with [`crate::netns::Netns::run`] and may then use it from any thread. All calls
//! block; the kernel answers these requests in microseconds.

use std::fmt::Debug;
use std::io;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_ACK_TLVS, NLM_F_CAPPED, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST,
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
};
use netlink_sys::{Socket, SocketAddr};

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket: {0}")]
    Io(#[from] io::Error),
    /// The kernel refused message `index` of the request (0 for single requests).
    #[error("kernel rejected netlink message {index}: {source}{}", ext_ack.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Kernel {
        index: usize,
        source: io::Error,
        /// The extended-ack text (`NLMSGERR_ATTR_MSG`), when the kernel gave one.
        ext_ack: Option<String>,
    },
    #[error("cannot decode netlink reply: {0}")]
    Decode(String),
    /// The table changed while it was being dumped; the caller should dump again.
    #[error("netlink dump interrupted by a concurrent change")]
    DumpInterrupted,
}

impl NetlinkError {
    /// The errno of a kernel rejection, if that is what this is.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Kernel { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// A connected netlink socket of one protocol (`netlink_sys::constants::NETLINK_*`).
pub struct NetlinkSocket {
    socket: Socket,
    next_seq: u32,
}

// The length of a read. The kernel sizes the buffer of each dump datagram by the largest read it
// has seen on the socket (up to 32 KiB): reads of 64 KiB made every datagram of every dump an
// order-3 allocation in the kernel, for replies of a few hundred bytes. At one page it uses its
// own default; a datagram that is larger anyway (one large message) is found by a peek first.
const READ_LEN: usize = 4096;

thread_local! {
    /// The receive buffer of every socket used on this thread. A buffer per socket came and went
    /// with each pod namespace a worker visited, and musl's allocator maps and unmaps an
    /// allocation this size each time: an agent restart with 250 pods unmapped hundreds of them,
    /// each unmap a TLB shootdown on every CPU running the agent. Only the pages a datagram
    /// touched become resident.
    static RECV: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Where a single request is serialized ([`NetlinkSocket::request`], [`NetlinkSocket::get`]):
    /// a pod's enrollment makes a dozen of them, routes and nftables generations.
    static SEND: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}
const NLMSGERR_ATTR_MSG: u16 = 1;
// Netlink control message types (<linux/netlink.h>).
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

impl NetlinkSocket {
    /// Opens a socket in the calling thread's network namespace.
    pub fn open(protocol: isize) -> Result<Self, NetlinkError> {
        let mut socket = Socket::new(protocol)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        // Best effort: older kernels simply do not attach the message text.
        let _ = socket.set_ext_ack(true);
        Ok(NetlinkSocket {
            socket,
            next_seq: 1,
        })
    }

    /// Asks the kernel to check dump requests strictly and to honour their filters (Linux 4.20+);
    /// false where it cannot, and then dumps return everything, as before.
    pub fn strict_check(&mut self) -> bool {
        self.socket.set_netlink_get_strict_chk(true).is_ok()
    }

    /// Sends one get request (not a dump) and returns the kernel's answer.
    pub fn get<T>(&mut self, payload: T) -> Result<Vec<T>, NetlinkError>
    where
        T: NetlinkSerializable + NetlinkDeserializable + Debug,
    {
        let mut answer = Vec::new();
        self.acked(payload, 0, |msg| {
            let reply = NetlinkMessage::<T>::deserialize(msg)
                .map_err(|e| NetlinkError::Decode(e.to_string()))?;
            if let NetlinkPayload::InnerMessage(m) = reply.payload {
                answer.push(m);
            }
            Ok(())
        })?;
        Ok(answer)
    }

    /// Sends one request and waits for its acknowledgement. `flags` is added to
    /// `NLM_F_REQUEST | NLM_F_ACK` (e.g. `NLM_F_CREATE | NLM_F_EXCL`).
    pub fn request<T>(&mut self, payload: T, flags: u16) -> Result<(), NetlinkError>
    where
        T: NetlinkSerializable + Debug,
    {
        self.acked(payload, flags, |_| Ok(()))
    }

    /// One message with `NLM_F_REQUEST | NLM_F_ACK | flags`, serialized into the thread's send
    /// buffer and exchanged; every reply other than the ack goes to `reply`.
    fn acked<T>(
        &mut self,
        payload: T,
        flags: u16,
        reply: impl FnMut(&[u8]) -> Result<(), NetlinkError>,
    ) -> Result<(), NetlinkError>
    where
        T: NetlinkSerializable + Debug,
    {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
        msg.finalize();
        SEND.with_borrow_mut(|buf| {
            buf.clear();
            buf.resize(msg.buffer_len(), 0);
            msg.serialize(buf);
            self.exchange(buf, &[(0, true)], reply)
        })
    }

    /// Sends a dump request and collects every reply until `NLMSG_DONE`.
    pub fn dump<T>(&mut self, payload: T) -> Result<Vec<T>, NetlinkError>
    where
        T: NetlinkSerializable + NetlinkDeserializable + Clone + Debug,
    {
        let replies = self.dump_raw(payload, |_| true)?;
        replies
            .iter()
            .map(|(message_type, payload)| {
                let mut header = NetlinkHeader::default();
                header.message_type = message_type;
                T::deserialize(&header, payload).map_err(|e| NetlinkError::Decode(e.to_string()))
            })
            .collect()
    }

    /// Sends a dump request and keeps, undecoded, every reply whose message type `keep`
    /// accepts, until `NLMSG_DONE`. A dump a concurrent change interrupted is taken again, a
    /// few times: a consistent one always comes.
    pub fn dump_raw<T>(
        &mut self,
        payload: T,
        keep: impl Fn(u16) -> bool,
    ) -> Result<Payloads, NetlinkError>
    where
        T: NetlinkSerializable + Clone + Debug,
    {
        let mut tries = 0;
        loop {
            match self.dump_once(payload.clone(), &keep) {
                Err(NetlinkError::DumpInterrupted) if tries < 5 => tries += 1,
                other => return other,
            }
        }
    }

    fn dump_once<T>(
        &mut self,
        payload: T,
        keep: impl Fn(u16) -> bool,
    ) -> Result<Payloads, NetlinkError>
    where
        T: NetlinkSerializable + Debug,
    {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let seq = self.alloc_seqs(1);
        header.sequence_number = seq;
        self.send(&mut [NetlinkMessage::new(
            header,
            NetlinkPayload::InnerMessage(payload),
        )])?;
        let mut replies = DumpReplies::new(seq, keep);
        while !replies.done() {
            self.recv_each(|msg| replies.take(msg))?;
        }
        replies.finish()
    }

    /// Sends `msgs` in one datagram (a netfilter batch, or several route requests) and waits until
    /// every message that asked for an ack (`NLM_F_ACK`) got one. Sequence numbers are assigned
    /// here. Returns the non-ack replies (e.g. `NLM_F_ECHO` copies), or the first rejection,
    /// naming the index of the refused message.
    pub fn transact<T>(
        &mut self,
        mut msgs: Vec<NetlinkMessage<T>>,
    ) -> Result<Vec<NetlinkMessage<T>>, NetlinkError>
    where
        T: NetlinkSerializable + NetlinkDeserializable + Debug,
    {
        let mut encoded = Encoded::new(&mut msgs);
        let mut replies = Vec::new();
        self.exchange(&mut encoded.bytes, &encoded.msgs, |msg| {
            replies.push(
                NetlinkMessage::<T>::deserialize(msg)
                    .map_err(|e| NetlinkError::Decode(e.to_string()))?,
            );
            Ok(())
        })?;
        Ok(replies)
    }

    /// [`transact`](Self::transact) of messages serialized before: they are numbered afresh and
    /// sent; replies other than acks are dropped.
    pub fn transact_encoded(&mut self, encoded: &mut Encoded) -> Result<(), NetlinkError> {
        self.exchange(&mut encoded.bytes, &encoded.msgs, |_| Ok(()))
    }

    /// Numbers and sends the messages serialized in `bytes` (`msgs`: where each starts, whether
    /// it asks for an ack), then reads until every message that asked for an ack got one,
    /// handing each other reply to one of them (header included) to `reply`. A rejection of a
    /// message that asked for no ack (the kernel reports failures unasked) counts as well.
    fn exchange(
        &mut self,
        bytes: &mut [u8],
        msgs: &[(usize, bool)],
        mut reply: impl FnMut(&[u8]) -> Result<(), NetlinkError>,
    ) -> Result<(), NetlinkError> {
        let first = self.alloc_seqs(msgs.len());
        let mut pending = 0;
        for (i, &(start, acked)) in msgs.iter().enumerate() {
            let seq = first + i as u32;
            bytes[start + 8..start + 12].copy_from_slice(&seq.to_ne_bytes());
            pending += usize::from(acked);
        }
        self.send_bytes(bytes)?;
        let mut first_err = None;
        while pending > 0 {
            self.recv_each(|msg| {
                let (message_type, _, seq) = header_of(msg);
                let index = seq.wrapping_sub(first) as usize;
                let Some(&(_, acked)) = msgs.get(index) else {
                    return Ok(());
                };
                if message_type != NLMSG_ERROR {
                    return reply(msg);
                }
                // The kernel answers a message once: with its ack, or with its refusal.
                pending -= usize::from(acked);
                if first_err.is_none() {
                    first_err = rejection(msg, index);
                }
                Ok(())
            })?;
            // A failed batch message aborts the rest; the kernel does not ack what it never ran.
            if first_err.is_some() && self.nothing_queued()? {
                break;
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `n` consecutive sequence numbers, the first returned: a reply's number then says which
    /// message it answers. Never 0 (the kernel's own notifications), never wrapping within the
    /// run: a run that would cross `u32::MAX` starts again at 1.
    fn alloc_seqs(&mut self, n: usize) -> u32 {
        let n = u32::try_from(n).expect("fewer than 2^32 messages in one datagram");
        if self.next_seq.checked_add(n).is_none() {
            self.next_seq = 1;
        }
        let first = self.next_seq;
        self.next_seq = first + n;
        first
    }

    fn send<T: NetlinkSerializable + Debug>(
        &mut self,
        msgs: &mut [NetlinkMessage<T>],
    ) -> Result<(), NetlinkError> {
        self.send_bytes(&Encoded::new(msgs).bytes)
    }

    fn send_bytes(&mut self, bytes: &[u8]) -> Result<(), NetlinkError> {
        let sent = self.socket.send(bytes, 0)?;
        if sent != bytes.len() {
            return Err(NetlinkError::Io(io::Error::other("short netlink send")));
        }
        Ok(())
    }

    /// Reads one datagram and hands each message in it, header included, to `each`.
    fn recv_each(
        &mut self,
        mut each: impl FnMut(&[u8]) -> Result<(), NetlinkError>,
    ) -> Result<(), NetlinkError> {
        RECV.with_borrow_mut(|buf| {
            self.recv_datagram(buf)?;
            messages(buf, &mut each)
        })
    }

    /// Reads one datagram into `buf`, whole however long.
    fn recv_datagram(&mut self, buf: &mut Vec<u8>) -> Result<(), NetlinkError> {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.socket);
        let read = |buf: &mut Vec<u8>, len: usize, flags: libc::c_int| loop {
            buf.clear();
            buf.reserve(len);
            // SAFETY: the kernel writes at most `len` bytes into the spare capacity just
            // reserved; the length is set to what it wrote.
            let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), len, flags) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let n = n as usize;
            // SAFETY: the first min(n, len) bytes were written by the kernel.
            unsafe { buf.set_len(n.min(len)) };
            return Ok(n);
        };
        let whole = read(buf, READ_LEN, libc::MSG_PEEK | libc::MSG_TRUNC)?;
        let len = whole.max(READ_LEN);
        let n = read(buf, len, 0)?;
        if n > buf.len() {
            return Err(NetlinkError::Decode(format!(
                "datagram of {n} bytes truncated"
            )));
        }
        Ok(())
    }

    fn nothing_queued(&self) -> Result<bool, NetlinkError> {
        let mut probe = [0u8; 1];
        // SAFETY: recv into a 1-byte stack buffer we own; MSG_PEEK|MSG_DONTWAIT never blocks or consumes.
        let n = unsafe {
            libc::recv(
                std::os::fd::AsRawFd::as_raw_fd(&self.socket),
                probe.as_mut_ptr().cast(),
                probe.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::WouldBlock {
                return Ok(true);
            }
            return Err(err.into());
        }
        Ok(false)
    }
}

impl std::os::fd::AsRawFd for NetlinkSocket {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.socket.as_raw_fd()
    }
}

/// Hands each message of a received datagram, header included, to `each`; a length that does not
/// fit the datagram is an error. Public, as [`DumpReplies`] is, so what arrives on a netlink
/// socket can be fuzzed (`fuzz/`).
pub fn messages(
    datagram: &[u8],
    mut each: impl FnMut(&[u8]) -> Result<(), NetlinkError>,
) -> Result<(), NetlinkError> {
    let mut off = 0;
    while off + 16 <= datagram.len() {
        let len = u32::from_ne_bytes(datagram[off..off + 4].try_into().expect("4 bytes")) as usize;
        if len < 16 || off + len > datagram.len() {
            return Err(NetlinkError::Decode(format!(
                "bad message length {len} at offset {off}"
            )));
        }
        each(&datagram[off..off + len])?;
        off += (len + 3) & !3;
    }
    Ok(())
}

/// The replies to one dump request as its messages arrive ([`messages`]): those of type `keep`
/// accepts are kept, undecoded, until `NLMSG_DONE`; a refusal ends it with the kernel's error,
/// an interruption with [`NetlinkError::DumpInterrupted`].
pub struct DumpReplies<K> {
    seq: u32,
    keep: K,
    out: Payloads,
    interrupted: bool,
    done: bool,
}

impl<K: Fn(u16) -> bool> DumpReplies<K> {
    /// The replies to the request numbered `seq`; other messages are ignored.
    pub fn new(seq: u32, keep: K) -> Self {
        DumpReplies {
            seq,
            keep,
            out: Payloads::default(),
            interrupted: false,
            done: false,
        }
    }

    /// Takes one received message, header included.
    pub fn take(&mut self, msg: &[u8]) -> Result<(), NetlinkError> {
        let (message_type, flags, reply_seq) = header_of(msg);
        if self.done || reply_seq != self.seq {
            return Ok(());
        }
        self.interrupted |= flags & NLM_F_DUMP_INTR != 0;
        match message_type {
            NLMSG_DONE => self.done = true,
            NLMSG_ERROR => {
                if let Some(refused) = rejection(msg, 0) {
                    return Err(refused);
                }
            }
            t if (self.keep)(t) => self.out.push(t, &msg[16..]),
            _ => {}
        }
        Ok(())
    }

    /// Whether `NLMSG_DONE` came.
    pub fn done(&self) -> bool {
        self.done
    }

    /// The kept replies, unless the dump was interrupted.
    pub fn finish(self) -> Result<Payloads, NetlinkError> {
        if self.interrupted {
            return Err(NetlinkError::DumpInterrupted);
        }
        Ok(self.out)
    }
}

/// A received message's type, flags and sequence number (`recv_each` hands over whole
/// headers only).
fn header_of(msg: &[u8]) -> (u16, u16, u32) {
    let u16_at = |at: usize| u16::from_ne_bytes([msg[at], msg[at + 1]]);
    let seq = u32::from_ne_bytes(msg[8..12].try_into().expect("4 bytes"));
    (u16_at(4), u16_at(6), seq)
}

/// The kernel's refusal of request `index` in an `NLMSG_ERROR` message; `None` for an ack.
fn rejection(msg: &[u8], index: usize) -> Option<NetlinkError> {
    // struct nlmsgerr: the error code (0 for an ack), then the request it answers.
    let code = msg
        .get(16..20)
        .map_or(0, |c| i32::from_ne_bytes(c.try_into().expect("4 bytes")));
    (code != 0).then(|| match code.checked_neg() {
        Some(errno) => NetlinkError::Kernel {
            index,
            source: io::Error::from_raw_os_error(errno),
            ext_ack: ext_ack_text(header_of(msg).1, msg),
        },
        None => NetlinkError::Decode(format!("netlink error code {code} names no errno")),
    })
}

/// Finds `NLMSGERR_ATTR_MSG` in an `NLMSG_ERROR` datagram: after the 16-byte outer header come the
/// errno (4 bytes) and the offending request (only its header when `NLM_F_CAPPED`), then TLVs.
fn ext_ack_text(flags: u16, raw: &[u8]) -> Option<String> {
    if flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    let inner = raw.get(20..)?;
    let inner_len = if flags & NLM_F_CAPPED != 0 {
        16
    } else {
        u32::from_ne_bytes(inner.get(0..4)?.try_into().ok()?) as usize
    };
    let tlvs = Nlas::parse(raw.get(20 + ((inner_len + 3) & !3)..)?)?;
    let text = tlvs.get(NLMSGERR_ATTR_MSG)?;
    let text = text.split(|b| *b == 0).next().unwrap_or_default();
    Some(String::from_utf8_lossy(text).into_owned())
}

/// Messages serialized once, to be sent as they are ([`NetlinkSocket::transact_encoded`]): a
/// pod's rules are the same batch for every pod with the same settings, and serializing it from
/// the netlink crate's types costs an allocation per attribute. Each send numbers the messages
/// afresh.
#[derive(Clone, Debug, Default)]
pub struct Encoded {
    bytes: Vec<u8>,
    /// Where each message starts, and whether it asks for an ack.
    msgs: Vec<(usize, bool)>,
}

impl Encoded {
    pub fn new<T: NetlinkSerializable + Debug>(msgs: &mut [NetlinkMessage<T>]) -> Self {
        let mut encoded = Encoded::default();
        for msg in msgs {
            msg.finalize();
            let start = encoded.bytes.len();
            encoded.bytes.resize(start + msg.buffer_len(), 0);
            msg.serialize(&mut encoded.bytes[start..]);
            encoded
                .msgs
                .push((start, msg.header.flags & NLM_F_ACK != 0));
        }
        encoded
    }
}

/// The replies of a dump, undecoded, each with its message type. One buffer holds them all:
/// reading a pod's rules back is a dump per object kind, and a buffer per reply was an
/// allocation per rule. The buffers are the thread's, kept between dumps: a pod's rules dump
/// to kilobytes, and musl maps an allocation that size on its own and unmaps it when freed, a
/// shootdown of the other CPUs' TLBs each time, several times per namespace a restart checks.
pub struct Payloads {
    bytes: Vec<u8>,
    ends: Vec<(u16, usize)>,
}

/// The two buffers of a [`Payloads`]: bytes, and each reply's type and end.
type PayloadBuffers = (Vec<u8>, Vec<(u16, usize)>);

thread_local! {
    static SPARE_PAYLOADS: std::cell::Cell<PayloadBuffers> =
        const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

impl Default for Payloads {
    fn default() -> Self {
        let (bytes, ends) = SPARE_PAYLOADS.take();
        Payloads { bytes, ends }
    }
}

impl Drop for Payloads {
    fn drop(&mut self) {
        let (mut bytes, mut ends) = (
            std::mem::take(&mut self.bytes),
            std::mem::take(&mut self.ends),
        );
        bytes.clear();
        ends.clear();
        // One set of buffers per thread, the larger if two dumps were alive at once.
        SPARE_PAYLOADS.with(|spare| {
            let kept = spare.take();
            spare.set(if kept.0.capacity() >= bytes.capacity() {
                kept
            } else {
                (bytes, ends)
            });
        });
    }
}

impl Payloads {
    fn push(&mut self, message_type: u16, payload: &[u8]) {
        self.bytes.extend_from_slice(payload);
        self.ends.push((message_type, self.bytes.len()));
    }

    /// Each reply's message type and payload (after the netlink header), in order.
    pub fn iter(&self) -> impl Iterator<Item = (u16, &[u8])> {
        let mut start = 0;
        self.ends.iter().map(move |&(message_type, end)| {
            let payload = &self.bytes[start..end];
            start = end;
            (message_type, payload)
        })
    }
}

/// A request in a netlink crate's types (`R`) whose replies stay bytes, for [`Nlas`] to read;
/// or a message built by hand, sent as its bytes.
#[derive(Debug)]
pub(crate) enum Raw<R> {
    Typed(R),
    Bytes { message_type: u16, payload: Vec<u8> },
}

impl<R: NetlinkSerializable> NetlinkSerializable for Raw<R> {
    fn message_type(&self) -> u16 {
        match self {
            Raw::Typed(m) => m.message_type(),
            Raw::Bytes { message_type, .. } => *message_type,
        }
    }

    fn buffer_len(&self) -> usize {
        match self {
            Raw::Typed(m) => m.buffer_len(),
            Raw::Bytes { payload, .. } => payload.len(),
        }
    }

    fn serialize(&self, buffer: &mut [u8]) {
        match self {
            Raw::Typed(m) => m.serialize(buffer),
            Raw::Bytes { payload, .. } => buffer.copy_from_slice(payload),
        }
    }
}

impl<R> NetlinkDeserializable for Raw<R> {
    type Error = std::convert::Infallible;

    fn deserialize(header: &NetlinkHeader, payload: &[u8]) -> Result<Self, Self::Error> {
        Ok(Raw::Bytes {
            message_type: header.message_type,
            payload: payload.to_vec(),
        })
    }
}

/// One netlink attribute stream, checked once to be well formed and then read in place: no
/// list of attributes is built, since a rule read back walks several streams per expression and
/// on the agent's static build every allocation takes musl's global lock. Read by hand: the
/// netlink crates' parsers format every buffer they walk into an error-context string, success
/// or not, which made reading a pod's nftables rules back cost milliseconds of CPU.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Nlas<'a>(&'a [u8]);

impl<'a> Nlas<'a> {
    /// `None` if an attribute's length is shorter than its header or runs past the buffer.
    pub(crate) fn parse(buf: &'a [u8]) -> Option<Self> {
        let mut rest = buf;
        while rest.len() >= 4 {
            let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
            if len < 4 || len > rest.len() {
                return None;
            }
            rest = rest.get((len + 3) & !3..).unwrap_or_default();
        }
        Some(Nlas(buf))
    }

    /// The (type, value) pairs, in order.
    pub(crate) fn iter(self) -> impl Iterator<Item = (u16, &'a [u8])> {
        let mut rest = self.0;
        std::iter::from_fn(move || {
            if rest.len() < 4 {
                return None;
            }
            let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
            let kind = u16::from_ne_bytes([rest[2], rest[3]]) & netlink_packet_core::NLA_TYPE_MASK;
            let value = &rest[4..len];
            rest = rest.get((len + 3) & !3..).unwrap_or_default();
            Some((kind, value))
        })
    }

    /// The value of the first attribute of type `kind`.
    pub(crate) fn get(self, kind: u16) -> Option<&'a [u8]> {
        self.iter().find(|(k, _)| *k == kind).map(|(_, v)| v)
    }

    /// The first attribute of type `kind` as an `NLA_U32` in network byte order (nf_tables).
    pub(crate) fn get_u32_be(self, kind: u16) -> Option<u32> {
        Some(u32::from_be_bytes(
            self.get(kind)?.get(..4)?.try_into().ok()?,
        ))
    }

    /// The first attribute of type `kind` as an `NLA_U32` in host byte order (rtnetlink).
    pub(crate) fn get_u32_ne(self, kind: u16) -> Option<u32> {
        Some(u32::from_ne_bytes(
            self.get(kind)?.get(..4)?.try_into().ok()?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use netlink_packet_route::RouteNetlinkMessage;
    use netlink_packet_route::link::{LinkAttribute, LinkMessage};
    use netlink_packet_route::route::RouteMessage;

    use super::*;

    #[test]
    fn an_error_code_that_names_no_errno_is_a_decode_error() {
        // Found by fuzzing (route_dump, fuzz/seeds/route_dump/crash-error-code-i32-min): the
        // code's negation overflowed.
        // nlmsghdr (length, type, flags, seq, port id), then the code.
        let mut msg = 20u32.to_ne_bytes().to_vec();
        msg.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        msg.extend_from_slice(&0u16.to_ne_bytes());
        msg.extend_from_slice(&1u32.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(&i32::MIN.to_ne_bytes());
        let mut replies = DumpReplies::new(1, |_| true);
        let err = messages(&msg, |m| replies.take(m)).unwrap_err();
        assert!(
            matches!(&err, NetlinkError::Decode(m) if m.contains("-2147483648")),
            "{err}"
        );
    }

    #[test]
    fn dump_lists_loopback() {
        let mut sock = NetlinkSocket::open(netlink_sys::constants::NETLINK_ROUTE).unwrap();
        let links = sock
            .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
            .unwrap();
        let names: Vec<String> = links
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                }),
                _ => None,
            })
            .collect();
        assert!(names.iter().any(|n| n == "lo"), "{names:?}");
        // The socket stays usable after a multi-part dump.
        let again = sock
            .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
            .unwrap();
        assert_eq!(again.len(), links.len());
    }

    #[test]
    fn rejection_carries_errno_and_index() {
        let mut sock = NetlinkSocket::open(netlink_sys::constants::NETLINK_ROUTE).unwrap();
        // A route message without a table or destination is refused (EINVAL as root, EPERM otherwise).
        let err = sock
            .request(RouteNetlinkMessage::DelRoute(RouteMessage::default()), 0)
            .unwrap_err();
        assert!(
            matches!(err, NetlinkError::Kernel { index: 0, .. }),
            "{err}"
        );
        assert!(err.errno().is_some());
        // A rejection does not desynchronise later requests.
        assert!(
            sock.dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
                .is_ok()
        );
    }

    #[test]
    fn sequence_numbers_of_a_datagram_never_wrap_inside_it() {
        let mut sock = NetlinkSocket::open(netlink_sys::constants::NETLINK_ROUTE).unwrap();
        sock.next_seq = u32::MAX - 3;
        assert_eq!(sock.alloc_seqs(3), u32::MAX - 3);
        assert_eq!(sock.alloc_seqs(3), 1, "a run crossing u32::MAX starts at 1");
        assert_eq!(sock.alloc_seqs(1), 4);
        // Answers still find their requests across the restart at 1.
        sock.next_seq = u32::MAX;
        let mut msg = LinkMessage::default();
        msg.header.index = 1;
        let lo = sock.get(RouteNetlinkMessage::GetLink(msg)).unwrap();
        assert_eq!(lo.len(), 1, "{lo:?}");
        let err = sock
            .request(RouteNetlinkMessage::DelRoute(RouteMessage::default()), 0)
            .unwrap_err();
        assert!(
            matches!(err, NetlinkError::Kernel { index: 0, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_datagram_longer_than_a_read_is_read_whole() {
        let mut sock = NetlinkSocket::open(netlink_sys::constants::NETLINK_ROUTE).unwrap();
        // The kernel's refusal (an alias too long, a link that does not exist) echoes the whole
        // request: a reply twice the length of a read, which a short read would have cut.
        let mut msg = LinkMessage::default();
        msg.header.index = u32::MAX - 1;
        msg.attributes
            .push(LinkAttribute::IfAlias("x".repeat(2 * READ_LEN)));
        let err = sock
            .get(RouteNetlinkMessage::GetLink(msg))
            .expect_err("refused");
        assert!(matches!(err, NetlinkError::Kernel { .. }), "{err}");
        // Read whole: nothing of it is left to be taken for the next reply.
        let links = sock
            .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
            .unwrap();
        assert!(!links.is_empty());
    }
}
