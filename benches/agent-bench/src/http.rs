//! A deliberately minimal HTTP/1.1 client over one keep-alive `TcpStream`: just enough to time
//! the agent without a client library's own overhead or buffering hiding in the numbers.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{bail, Context, Result};

pub struct Conn {
    reader: BufReader<TcpStream>,
}

pub struct Response {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

impl Conn {
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Conn> {
        let s = TcpStream::connect_timeout(&addr, timeout)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(Conn {
            reader: BufReader::with_capacity(64 * 1024, s),
        })
    }

    /// Sends one request (head and body in a single write) and reads the whole response.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Response> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        let mut buf = req.into_bytes();
        buf.extend_from_slice(body);
        self.reader.get_mut().write_all(&buf)?;
        self.read_response()
    }

    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("connection closed by the agent");
        }
        Ok(line.trim_end_matches(['\r', '\n']).to_string())
    }

    fn read_response(&mut self) -> Result<Response> {
        let status_line = self.read_line()?;
        let status: u16 = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {status_line:?}"))?;
        let (mut length, mut chunked, mut content_type) = (None, false, String::new());
        loop {
            let line = self.read_line()?;
            if line.is_empty() {
                break;
            }
            let Some((k, v)) = line.split_once(':') else {
                bail!("bad header line {line:?}");
            };
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            match k.as_str() {
                "content-length" => length = Some(v.parse::<usize>()?),
                "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
                "content-type" => content_type = v.to_string(),
                _ => {}
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                let size_line = self.read_line()?;
                let size_hex = size_line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size_hex, 16)
                    .with_context(|| format!("bad chunk size {size_line:?}"))?;
                if size == 0 {
                    // Trailers, then the blank line that ends the message.
                    while !self.read_line()?.is_empty() {}
                    break;
                }
                let start = body.len();
                body.resize(start + size, 0);
                self.reader.read_exact(&mut body[start..])?;
                let mut crlf = [0u8; 2];
                self.reader.read_exact(&mut crlf)?;
            }
        } else if let Some(n) = length {
            body.resize(n, 0);
            self.reader.read_exact(&mut body)?;
        }
        Ok(Response {
            status,
            content_type,
            body,
        })
    }
}

/// Splits a Connect streaming body into (flags, payload) envelopes.
pub fn envelopes(body: &[u8]) -> Result<Vec<(u8, &[u8])>> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        if rest.len() < 5 {
            bail!("truncated envelope header");
        }
        let flags = rest[0];
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        if rest.len() < 5 + len {
            bail!("envelope longer than the body");
        }
        out.push((flags, &rest[5..5 + len]));
        rest = &rest[5 + len..];
    }
    Ok(out)
}

pub fn envelope(json: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(json.len() + 5);
    v.push(0);
    v.extend_from_slice(&(json.len() as u32).to_be_bytes());
    v.extend_from_slice(json);
    v
}
