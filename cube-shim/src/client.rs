//! Blocking client of the control API (one connection, requests in order).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::protocol::{Body, ErrorKind, Op, Reply, Request, Response};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect to shim socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("shim connection: {0}")]
    Io(#[from] std::io::Error),
    /// The shim closed the connection (it exited or was killed).
    #[error("shim closed the connection")]
    Closed,
    #[error("shim sent an unreadable response: {0}")]
    BadResponse(String),
    /// The shim answered with an error.
    #[error("shim refused {op}: {kind:?}: {message}")]
    Shim {
        op: &'static str,
        kind: ErrorKind,
        message: String,
    },
}

impl ClientError {
    /// The shim's error class, when the shim answered with one.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Shim { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let s = UnixStream::connect(path).map_err(|e| ClientError::Connect {
            path: path.display().to_string(),
            source: e,
        })?;
        let writer = s.try_clone()?;
        Ok(Client {
            reader: BufReader::new(s),
            writer,
        })
    }

    /// Limits how long one response may take (None = forever).
    pub fn set_timeout(&self, t: Option<Duration>) -> Result<(), ClientError> {
        self.writer.set_read_timeout(t)?;
        Ok(())
    }

    /// Sends one raw line and returns the raw response line (tests of malformed input).
    pub fn raw(&mut self, line: &str) -> Result<String, ClientError> {
        let mut l = line.to_string();
        l.push('\n');
        self.writer.write_all(l.as_bytes())?;
        let mut out = String::new();
        if self.reader.read_line(&mut out)? == 0 {
            return Err(ClientError::Closed);
        }
        Ok(out)
    }

    /// Sends `op` and returns the shim's reply or its typed error.
    pub fn call(&mut self, op: Op) -> Result<Reply, ClientError> {
        let name = op.name();
        let line = serde_json::to_string(&Request::new(op))
            .map_err(|e| ClientError::BadResponse(format!("encode request: {e}")))?;
        let resp = self.raw(&line)?;
        let resp: Response = serde_json::from_str(&resp)
            .map_err(|e| ClientError::BadResponse(format!("{e}: {resp:?}")))?;
        match resp.body {
            Body::Ok(r) => Ok(r),
            Body::Err(e) => Err(ClientError::Shim {
                op: name,
                kind: e.kind,
                message: e.message,
            }),
        }
    }
}
