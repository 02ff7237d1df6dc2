//! The Connect protocol (JSON codec): error codes, envelopes, and response builders.

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;

/// Largest Connect message (envelope payload or unary body) the agent accepts.
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Envelope flag: this is the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Envelope flag: the payload is compressed (not supported).
pub const FLAG_COMPRESSED: u8 = 0x01;

/// Connect error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// HTTP status for a unary error, per the Connect specification.
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal | Code::DataLoss => 500,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists | Code::Aborted => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }
}

/// A Connect error: code plus message.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// The JSON error object (`{"code":"…","message":"…"}`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }

    /// Maps an I/O error on `what` to the code envd uses.
    pub fn from_io(e: &std::io::Error, what: &str) -> Self {
        let code = match e.raw_os_error() {
            Some(libc::ENOENT) => Code::NotFound,
            Some(libc::EEXIST) => Code::AlreadyExists,
            Some(libc::EACCES) | Some(libc::EPERM) => Code::PermissionDenied,
            Some(libc::ENOTDIR)
            | Some(libc::EISDIR)
            | Some(libc::EINVAL)
            | Some(libc::ENAMETOOLONG)
            | Some(libc::ENOTEMPTY) => Code::InvalidArgument,
            Some(libc::ELOOP) => Code::FailedPrecondition,
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => Code::ResourceExhausted,
            _ => Code::Internal,
        };
        let msg = match code {
            Code::NotFound => format!("file not found: {what}: {e}"),
            _ => format!("{what}: {e}"),
        };
        RpcError::new(code, msg)
    }
}

impl From<std::io::Error> for RpcError {
    fn from(e: std::io::Error) -> Self {
        RpcError::from_io(&e, "i/o")
    }
}

/// Frames one message as an envelope.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// A message envelope holding `msg` as JSON.
pub fn message_envelope<T: Serialize>(msg: &T) -> Bytes {
    let json = serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec());
    envelope(0, &json)
}

/// The end-of-stream envelope: `{}` on success, or `{"error":{…}}`.
pub fn end_stream_envelope(err: Option<&RpcError>) -> Bytes {
    let body = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.to_json()}),
    };
    envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// One parsed envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

/// Incremental envelope parser: feed bytes, take complete envelopes.
#[derive(Default)]
pub struct EnvelopeReader {
    buf: BytesMut,
}

impl EnvelopeReader {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete envelope, `Ok(None)` if more bytes are needed.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, RpcError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flags & FLAG_COMPRESSED != 0 {
            return Err(RpcError::new(
                Code::Unimplemented,
                "compressed envelopes are not supported (use identity encoding)",
            ));
        }
        if flags & !(FLAG_END_STREAM) != 0 {
            return Err(RpcError::invalid(format!(
                "invalid envelope flags 0x{flags:02x}"
            )));
        }
        if len > MAX_MESSAGE_BYTES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("message of {len} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes"),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let mut frame = self.buf.split_to(5 + len);
        let payload = frame.split_off(5).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    /// Bytes buffered but not yet forming a complete envelope.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// Parses a JSON message, mapping failures to `invalid_argument`.
pub fn decode_json<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Result<T, RpcError> {
    let text = std::str::from_utf8(payload)
        .map_err(|e| RpcError::invalid(format!("message is not valid UTF-8: {e}")))?;
    let text = if text.trim().is_empty() { "{}" } else { text };
    serde_json::from_str(text).map_err(|e| RpcError::invalid(format!("invalid JSON message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trip_in_pieces() {
        let a = envelope(0, b"{\"a\":1}");
        let b = end_stream_envelope(None);
        let mut all = a.to_vec();
        all.extend_from_slice(&b);
        let mut r = EnvelopeReader::new();
        let mut got = vec![];
        for byte in all {
            r.push(&[byte]);
            while let Some(e) = r.next_envelope().unwrap() {
                got.push(e);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(&got[0].payload[..], b"{\"a\":1}");
        assert_eq!(got[1].flags, FLAG_END_STREAM);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn rejects_bad_flags_and_huge_lengths() {
        let mut r = EnvelopeReader::new();
        r.push(&[0x80, 0, 0, 0, 0]);
        assert_eq!(r.next_envelope().unwrap_err().code, Code::InvalidArgument);
        let mut r = EnvelopeReader::new();
        r.push(&[0x01, 0, 0, 0, 0]);
        assert_eq!(r.next_envelope().unwrap_err().code, Code::Unimplemented);
        let mut r = EnvelopeReader::new();
        r.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.next_envelope().unwrap_err().code, Code::ResourceExhausted);
    }

    #[test]
    fn decode_errors_are_invalid_argument() {
        #[derive(serde::Deserialize, Debug)]
        struct M {
            #[allow(dead_code)]
            a: Option<u32>,
        }
        assert_eq!(
            decode_json::<M>(b"{").unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            decode_json::<M>(&[0xff, 0xfe]).unwrap_err().code,
            Code::InvalidArgument
        );
        assert!(decode_json::<M>(b"").is_ok());
    }
}
