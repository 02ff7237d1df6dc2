//! A small keep-alive HTTP/1.1 client on hyper: one connection per worker and endpoint, so the
//! measured latency is the server's, not connection setup (the SDKs keep connections alive too).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::time::Duration;
use tokio::net::TcpStream;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("invalid URL {0:?}: {1}")]
    Url(String, &'static str),
    #[error("connecting to {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("HTTP to {0}: {1}")]
    Hyper(String, hyper::Error),
    #[error("request to {0} timed out after {1:?}")]
    Timeout(String, Duration),
    #[error("building request: {0}")]
    Build(#[from] hyper::http::Error),
}

/// `http://host:port/prefix`, parsed once.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    /// Path prefix without a trailing slash ("" for none).
    pub prefix: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, HttpError> {
        let rest = if let Some(r) = url.strip_prefix("http://") {
            r
        } else if url.starts_with("https://") {
            return Err(HttpError::Url(
                url.into(),
                "https is not supported: point cube-bench at the plain-HTTP API and edge (as `cubectl up` prints them)",
            ));
        } else {
            return Err(HttpError::Url(url.into(), "must start with http://"));
        };
        let (auth, path) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (host, port) = if let Some(v6) = auth.strip_prefix('[') {
            let end = v6
                .find(']')
                .ok_or(HttpError::Url(url.into(), "unclosed [ in host"))?;
            let port = v6[end + 1..].strip_prefix(':').unwrap_or("80");
            (v6[..end].to_string(), port)
        } else {
            match auth.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), p),
                None => (auth.to_string(), "80"),
            }
        };
        if host.is_empty() {
            return Err(HttpError::Url(url.into(), "empty host"));
        }
        let port = port
            .parse::<u16>()
            .map_err(|_| HttpError::Url(url.into(), "bad port"))?;
        Ok(Endpoint {
            host,
            port,
            prefix: path.to_string(),
        })
    }

    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// True when the host is a loopback name or address (the API runs on this machine).
    pub fn is_loopback(&self) -> bool {
        self.host == "localhost"
            || self
                .host
                .parse::<std::net::IpAddr>()
                .map(|a| a.is_loopback())
                .unwrap_or(false)
    }
}

pub struct Response {
    pub status: u16,
    pub body: Bytes,
}

impl Response {
    /// The body as text, shortened for error messages.
    pub fn snippet(&self) -> String {
        let s = String::from_utf8_lossy(&self.body);
        let s = s.trim();
        if s.len() > 200 {
            let mut end = 200;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}…", &s[..end])
        } else {
            s.to_string()
        }
    }
}

/// One kept-alive connection to one endpoint; reconnects when the server closed it.
pub struct Conn {
    ep: Endpoint,
    timeout: Duration,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Conn {
    pub fn new(ep: Endpoint, timeout: Duration) -> Conn {
        Conn {
            ep,
            timeout,
            sender: None,
        }
    }

    async fn ready_sender(&mut self) -> Result<&mut SendRequest<Full<Bytes>>, HttpError> {
        // A connection the server closed while idle is replaced before anything is sent, so no
        // request is ever sent twice.
        let usable = match &mut self.sender {
            Some(s) => s.ready().await.is_ok(),
            None => false,
        };
        if !usable {
            let auth = self.ep.authority();
            let tcp = TcpStream::connect((self.ep.host.as_str(), self.ep.port))
                .await
                .map_err(|e| HttpError::Connect(auth.clone(), e))?;
            let _ = tcp.set_nodelay(true);
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .map_err(|e| HttpError::Hyper(auth, e))?;
            tokio::spawn(async move {
                // Ends when the connection closes; errors surface on the request side.
                let _ = conn.await;
            });
            self.sender = Some(sender);
        }
        // Set just above.
        self.sender
            .as_mut()
            .ok_or_else(|| HttpError::Url(String::new(), "no connection"))
    }

    /// Sends one request and reads the whole response body.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> Result<Response, HttpError> {
        let uri = format!("{}{}", self.ep.prefix, path);
        let what = format!("{method} {}{uri}", self.ep.authority());
        let mut b = hyper::Request::builder()
            .method(method)
            .uri(&uri)
            .header("host", self.ep.authority())
            .header(
                "user-agent",
                concat!("cube-bench/", env!("CARGO_PKG_VERSION")),
            );
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let req = b.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let timeout = self.timeout;
        let fut = async {
            let sender = self.ready_sender().await?;
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| HttpError::Hyper(what.clone(), e))?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| HttpError::Hyper(what.clone(), e))?
                .to_bytes();
            Ok(Response { status, body })
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => {
                if r.is_err() {
                    self.sender = None;
                }
                r
            }
            Err(_) => {
                self.sender = None;
                Err(HttpError::Timeout(what, timeout))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let e = Endpoint::parse("http://127.0.0.1:3000").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.prefix.as_str()),
            ("127.0.0.1", 3000, "")
        );
        assert!(e.is_loopback());
        let e = Endpoint::parse("http://api.example:8080/base/").unwrap();
        assert_eq!(e.prefix, "/base");
        assert!(!e.is_loopback());
        let e = Endpoint::parse("http://[::1]:3001").unwrap();
        assert_eq!(e.authority(), "[::1]:3001");
        assert!(e.is_loopback());
        assert_eq!(Endpoint::parse("http://localhost").unwrap().port, 80);
        assert!(Endpoint::parse("https://x").is_err());
        assert!(Endpoint::parse("ftp://x").is_err());
        assert!(Endpoint::parse("http://x:notaport").is_err());
        assert!(Endpoint::parse("http://:80").is_err());
    }
}
