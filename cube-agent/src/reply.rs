//! What every envd and interpreter handler answers with: the body type, plain-HTTP and Connect
//! responses, and envd's error shapes. A leaf: it imports no handler and no router.

use crate::connect::{self, RpcError};
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body::{Frame, SizeHint};
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

/// envd's answer to a request without the sandbox's access token.
pub const UNAUTHORIZED: &str =
    "unauthorized access, please provide a valid access token or method signing if supported";

/// Response bodies: a complete buffer, or a stream of chunks each flushed as it comes.
pub enum Body {
    Full(Option<Bytes>),
    Chan(mpsc::Receiver<Bytes>),
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Chan(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Body::Full(None) => SizeHint::with_exact(0),
            Body::Chan(_) => SizeHint::default(),
        }
    }
}

pub type Resp = Response<Body>;

pub fn response(status: u16, content_type: &str, body: Bytes) -> Resp {
    let mut r = Response::new(Body::Full(Some(body)));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if let Ok(v) = HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

pub fn empty(status: u16) -> Resp {
    let mut r = Response::new(Body::Full(None));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r
}

pub fn json_response(status: u16, v: &serde_json::Value) -> Resp {
    response(status, "application/json", Bytes::from(v.to_string()))
}

/// envd's plain-HTTP error body: `{"code": <status>, "message": "…"}`.
pub fn http_error(status: u16, message: impl Into<String>) -> Resp {
    json_response(
        status,
        &serde_json::json!({"code": status, "message": message.into()}),
    )
}

pub fn rpc_ok<T: serde::Serialize>(msg: &T) -> Resp {
    match serde_json::to_vec(msg) {
        Ok(v) => response(200, "application/json", Bytes::from(v)),
        Err(e) => rpc_err(&RpcError::internal(format!("encoding response: {e}"))),
    }
}

pub fn rpc_err(e: &RpcError) -> Resp {
    json_response(e.code.http_status(), &e.to_json())
}

pub fn rpc_result(r: Result<(), RpcError>) -> Resp {
    match r {
        Ok(()) => rpc_ok(&serde_json::json!({})),
        Err(e) => rpc_err(&e),
    }
}

/// A streaming Connect response and the sender that feeds it envelopes.
pub fn stream_response() -> (mpsc::Sender<Bytes>, Resp) {
    let (tx, rx) = mpsc::channel(64);
    let mut r = Response::new(Body::Chan(rx));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    (tx, r)
}

/// A streaming response that fails immediately (200 + end-stream error, as connect-go does).
pub fn stream_error(e: &RpcError) -> Resp {
    let mut r = response(
        200,
        "application/connect+json",
        connect::end_stream_envelope(Some(e)),
    );
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    r
}
