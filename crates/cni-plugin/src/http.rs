//! Just enough HTTP/1.1 client for three peers: the agent's unix sockets and the API server. One
//! request per connection (`Connection: close`), a hard deadline for the whole exchange, bodies
//! framed by `Content-Length`, chunked encoding, or EOF.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    /// The body as text for error messages (lossy, trimmed).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).trim().to_owned()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The peer could not be reached or the exchange broke or timed out.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The peer answered something that is not HTTP/1.x.
    #[error("malformed HTTP response: {0}")]
    Malformed(String),
    #[error("HTTP response body larger than {0} bytes")]
    TooLarge(usize),
}

/// Sockets whose blocking calls can be bounded.
pub trait SetTimeouts {
    fn set_timeouts(&self, t: Duration) -> io::Result<()>;
}

impl SetTimeouts for UnixStream {
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

impl SetTimeouts for TcpStream {
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

/// A socket whose every read and write is bounded by what is left of one deadline, so a peer that
/// trickles bytes cannot stretch the exchange.
pub struct Deadline<S> {
    inner: S,
    until: Instant,
}

impl<S: SetTimeouts> Deadline<S> {
    pub fn new(inner: S, until: Instant) -> Self {
        Deadline { inner, until }
    }

    fn arm(&self) -> io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline exceeded"));
        }
        self.inner.set_timeouts(left)
    }
}

impl<S: SetTimeouts + Read> Read for Deadline<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        self.inner.read(buf)
    }
}

impl<S: SetTimeouts + Write> Write for Deadline<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

pub struct Request<'a> {
    pub method: &'a str,
    pub host: &'a str,
    pub path: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub body: &'a [u8],
}

/// `<binary>/<version>`, the form of Istio's `IstioUserAgent`, so API server audit logs tell the
/// plugin's fallback lookups apart from other clients.
pub const USER_AGENT: &str = concat!("istio-cni/", env!("CARGO_PKG_VERSION"));

/// Sends `req` and reads the whole response (body capped at `max_body` bytes).
pub fn exchange<S: Read + Write>(
    stream: &mut S,
    req: &Request<'_>,
    max_body: usize,
) -> Result<Response, HttpError> {
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nUser-Agent: {USER_AGENT}\r\n",
        req.method, req.path, req.host
    );
    for (k, v) in req.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if req.method != "GET" || !req.body.is_empty() {
        head.push_str(&format!("Content-Length: {}\r\n", req.body.len()));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(req.body);
    stream.write_all(&out)?;
    stream.flush()?;
    read_response(stream, max_body)
}

/// Parses one response from `stream`.
pub fn read_response<R: Read>(stream: &mut R, max_body: usize) -> Result<Response, HttpError> {
    let mut buf = Vec::with_capacity(4096);
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        if buf.len() > 64 * 1024 {
            return Err(HttpError::Malformed("header section too large".into()));
        }
        if read_some(stream, &mut buf)? == 0 {
            return Err(HttpError::Malformed(
                "connection closed before the response header ended".into(),
            ));
        }
    };
    let head = std::str::from_utf8(&buf[..head_end])
        .map_err(|_| HttpError::Malformed("header is not UTF-8".into()))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::Malformed(format!("status line {status_line:?}")));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HttpError::Malformed(format!("status line {status_line:?}")))?;
    let mut content_length = None;
    let mut chunked = false;
    for line in lines {
        let Some((k, v)) = line.split_once(':') else {
            return Err(HttpError::Malformed(format!("header line {line:?}")));
        };
        let (k, v) = (k.trim(), v.trim());
        if k.eq_ignore_ascii_case("content-length") {
            let n: usize = v
                .parse()
                .map_err(|_| HttpError::Malformed(format!("Content-Length {v:?}")))?;
            content_length = Some(n);
        } else if k.eq_ignore_ascii_case("transfer-encoding")
            && v.to_ascii_lowercase().contains("chunked")
        {
            chunked = true;
        }
    }
    let mut rest = buf.split_off(head_end + 4);
    let body = if chunked {
        read_chunked(stream, rest, max_body)?
    } else if matches!(status, 100..=199 | 204 | 304) {
        Vec::new()
    } else if let Some(n) = content_length {
        if n > max_body {
            return Err(HttpError::TooLarge(max_body));
        }
        while rest.len() < n {
            if read_some(stream, &mut rest)? == 0 {
                return Err(HttpError::Malformed(
                    "connection closed inside the body".into(),
                ));
            }
        }
        rest.truncate(n);
        rest
    } else {
        loop {
            if rest.len() > max_body {
                return Err(HttpError::TooLarge(max_body));
            }
            if read_some(stream, &mut rest)? == 0 {
                break rest;
            }
        }
    };
    Ok(Response { status, body })
}

fn read_chunked<R: Read>(
    stream: &mut R,
    mut buf: Vec<u8>,
    max_body: usize,
) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(i) = find(&buf, b"\r\n") {
                break i;
            }
            if read_some(stream, &mut buf)? == 0 {
                return Err(HttpError::Malformed(
                    "connection closed inside a chunk header".into(),
                ));
            }
        };
        let size_text = std::str::from_utf8(&buf[..line_end]).unwrap_or_default();
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| HttpError::Malformed(format!("chunk size {size_text:?}")))?;
        buf.drain(..line_end + 2);
        if size == 0 {
            return Ok(body);
        }
        if body.len() + size > max_body {
            return Err(HttpError::TooLarge(max_body));
        }
        while buf.len() < size + 2 {
            if read_some(stream, &mut buf)? == 0 {
                return Err(HttpError::Malformed(
                    "connection closed inside a chunk".into(),
                ));
            }
        }
        body.extend_from_slice(&buf[..size]);
        buf.drain(..size + 2);
    }
}

fn read_some<R: Read>(stream: &mut R, buf: &mut Vec<u8>) -> io::Result<usize> {
    let mut chunk = [0u8; 8192];
    loop {
        match stream.read(&mut chunk) {
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // Timeouts surface as WouldBlock on Linux sockets; report them as what they are.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "timed out waiting for the peer",
                ));
            }
            Err(e) => return Err(e),
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that answers with fixed bytes and records what it was sent.
    struct Canned {
        reply: io::Cursor<Vec<u8>>,
        sent: Vec<u8>,
    }

    impl Read for Canned {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            // One byte at a time: every parser path must cope with fragmented reads.
            let n = buf.len().min(1);
            self.reply.read(&mut buf[..n])
        }
    }

    impl Write for Canned {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.sent.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn run(reply: &str, max: usize) -> (Result<Response, HttpError>, String) {
        let mut c = Canned {
            reply: io::Cursor::new(reply.as_bytes().to_vec()),
            sent: vec![],
        };
        let req = Request {
            method: "POST",
            host: "unix",
            path: "/v1/cmdadd",
            headers: &[("Content-Type", "application/json")],
            body: b"{}",
        };
        let r = exchange(&mut c, &req, max);
        (r, String::from_utf8(c.sent).unwrap())
    }

    #[test]
    fn writes_a_complete_request() {
        let (_, sent) = run("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", 10);
        assert_eq!(
            sent,
            format!(
                "POST /v1/cmdadd HTTP/1.1\r\nHost: unix\r\nConnection: close\r\nUser-Agent: istio-cni/{}\r\n\
                 Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}",
                env!("CARGO_PKG_VERSION")
            )
        );
    }

    #[test]
    fn content_length_body() {
        let (r, _) = run(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 5\r\n\r\nhello-extra",
            100,
        );
        let r = r.unwrap();
        assert_eq!((r.status, r.text().as_str()), (500, "hello"));
    }

    #[test]
    fn chunked_body() {
        let (r, _) = run(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            100,
        );
        assert_eq!(r.unwrap().body, b"hello world");
    }

    #[test]
    fn body_until_eof() {
        let (r, _) = run("HTTP/1.0 404 Not Found\r\n\r\n404 page not found\n", 100);
        let r = r.unwrap();
        assert_eq!((r.status, r.text().as_str()), (404, "404 page not found"));
    }

    #[test]
    fn limits_and_garbage() {
        assert!(matches!(
            run("HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n", 10).0,
            Err(HttpError::TooLarge(10))
        ));
        assert!(matches!(
            run("HTTP/1.1 200 OK\r\n\r\n0123456789abc", 10).0,
            Err(HttpError::TooLarge(10))
        ));
        assert!(matches!(
            run("SSH-2.0-OpenSSH\r\n\r\n", 10).0,
            Err(HttpError::Malformed(_))
        ));
        assert!(matches!(
            run("HTTP/1.1 200 OK\r\nCont", 10).0,
            Err(HttpError::Malformed(_))
        ));
        assert!(matches!(
            run("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", 10).0,
            Err(HttpError::Malformed(_))
        ));
    }

    #[test]
    fn deadline_in_the_past_times_out() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut d = Deadline::new(a, Instant::now());
        let e = d.read(&mut [0u8; 4]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn silent_peer_times_out() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut d = Deadline::new(a, Instant::now() + Duration::from_millis(50));
        let start = Instant::now();
        let e = read_response(&mut d, 10).unwrap_err();
        assert!(
            matches!(e, HttpError::Io(ref io) if io.kind() == io::ErrorKind::TimedOut),
            "{e}"
        );
        assert!(start.elapsed() < Duration::from_secs(2));
    }
}
