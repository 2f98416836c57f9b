//! The byte forms nftables messages share: NUL-terminated names and libnftnl's user-data TLVs
//! (comments). Apart from the message codecs (`wire`, `expr`) that both read them.

pub(crate) fn push_tlv(out: &mut Vec<u8>, kind: u8, value: &[u8]) {
    out.push(kind);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

/// Finds a libnftnl user-data TLV and returns its value.
pub(crate) fn find_tlv(mut data: &[u8], kind: u8) -> Option<&[u8]> {
    while data.len() >= 2 {
        let (k, len) = (data[0], data[1] as usize);
        let value = data.get(2..2 + len)?;
        if k == kind {
            return Some(value);
        }
        data = &data[2 + len..];
    }
    None
}

pub(crate) fn nul_terminated(s: &str) -> Vec<u8> {
    // A TLV length is one byte; a longer comment is cut rather than corrupting the TLV.
    let mut v: Vec<u8> = s.as_bytes().iter().copied().take(254).collect();
    v.push(0);
    v
}

/// A NUL-terminated name, borrowed; one that is not UTF-8 reads as such (names of ours and of
/// any nft tool always are).
pub(crate) fn str_of(value: &[u8]) -> &str {
    let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
    std::str::from_utf8(&value[..end]).unwrap_or("(not UTF-8)")
}

pub(crate) fn string_of(value: &[u8]) -> String {
    let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}
