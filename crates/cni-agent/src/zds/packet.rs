//! One ZDS datagram in, one out: SEQPACKET framing, the 1024-byte limit and fd passing.
//!
//! Shared by the server and the test peer so both ends apply the same checks ztunnel applies:
//! a truncated datagram or truncated control data is an error, never a shorter message.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use cni_core::zds::MAX_MESSAGE_LEN;
use tokio_seqpacket::UnixSeqpacket;
use tokio_seqpacket::ancillary::{AncillaryMessageWriter, OwnedAncillaryMessage};

#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    #[error("received truncated message")]
    Truncated,
    #[error("received truncated control message")]
    ControlTruncated,
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
}

/// A received datagram and the fds that came with it (already owned: closed when dropped).
#[derive(Debug)]
pub struct Datagram {
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

// Room for a few fds so a peer that sends more than one is detected (and its fds closed) rather
// than reported as control truncation.
const CONTROL_LEN: usize = 128;

pub async fn send(
    sock: &UnixSeqpacket,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let sent = match fd {
        None => sock.send(bytes).await?,
        Some(fd) => {
            let mut control = [0u8; CONTROL_LEN];
            let mut ancillary = AncillaryMessageWriter::new(&mut control);
            ancillary
                .add_fds([fd])
                .map_err(|_| io::Error::other("control buffer too small for one fd"))?;
            sock.send_with_ancillary(bytes, &mut ancillary).await?
        }
    };
    if sent != bytes.len() {
        return Err(io::Error::other(format!(
            "short send: {sent} of {} bytes",
            bytes.len()
        )));
    }
    Ok(())
}

/// Receives one datagram. `Ok(None)` is end of stream: SEQPACKET reports a closed peer as a
/// zero-length read, and no valid ZDS message we exchange is empty.
pub async fn recv(sock: &UnixSeqpacket) -> Result<Option<Datagram>, PacketError> {
    let mut buf = [0u8; MAX_MESSAGE_LEN];
    let mut control = [0u8; CONTROL_LEN];
    let (info, ancillary) = sock.recv_with_ancillary(&mut buf, &mut control).await?;
    let mut fds = Vec::new();
    let control_truncated = ancillary.is_truncated();
    for msg in ancillary.into_messages() {
        if let OwnedAncillaryMessage::FileDescriptors(received) = msg {
            fds.extend(received);
        }
    }
    if info.truncated() {
        return Err(PacketError::Truncated);
    }
    if control_truncated || info.ancillary_truncated() {
        return Err(PacketError::ControlTruncated);
    }
    if info.bytes_read() == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some(Datagram {
        bytes: buf[..info.bytes_read()].to_vec(),
        fds,
    }))
}
