//! A gRPC channel that rides out a restart of its peer: a call that fails in transport
//! (connection refused or reset: the peer is restarting) is resent with a backoff until a time
//! budget is spent, and only then fails, as `Unavailable`. Only for services whose every call is
//! safe to send twice (idempotent, or carrying a key the peer deduplicates by).
//!
//! Over several peers of which one serves (a leading cube-master and its standbys, which do not
//! listen): a call failing in transport goes to the next peer at once, the backoff comes after a
//! round in which none answered, and later calls start at the peer that answered last.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tonic::body::BoxBody;
use tonic::transport::Channel;
use tower::ServiceExt;

/// First wait before a resend; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A channel that buffers each request (a unary one: the response may stream) so it can be
/// sent again.
#[derive(Clone, Debug)]
pub struct Retrying {
    channels: Arc<[Channel]>,
    /// Index of the peer that answered last.
    current: Arc<AtomicUsize>,
    budget: Duration,
    /// What is at the other end, for the error ("cube-master", "node").
    peer: &'static str,
}

impl Retrying {
    /// Resends a call failing in transport for up to `budget` (`Duration::ZERO`: one try).
    pub fn new(channel: Channel, budget: Duration, peer: &'static str) -> Retrying {
        Retrying::over(vec![channel], budget, peer)
    }

    /// Over several peers, one of which serves; at least one channel.
    pub fn over(channels: Vec<Channel>, budget: Duration, peer: &'static str) -> Retrying {
        assert!(!channels.is_empty(), "Retrying::over needs a channel");
        Retrying {
            channels: channels.into(),
            current: Arc::new(AtomicUsize::new(0)),
            budget,
            peer,
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<http::Request<BoxBody>> for Retrying {
    type Response = http::Response<BoxBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Readiness is awaited per try, on a clone of the channel.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<BoxBody>) -> Self::Future {
        let (channels, current) = (self.channels.clone(), self.current.clone());
        let (budget, peer) = (self.budget, self.peer);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body: Bytes = body.collect().await.map_err(Box::new)?.to_bytes();
            let deadline = Instant::now() + budget;
            let mut backoff = FIRST_BACKOFF;
            let n = channels.len();
            let mut at = current.load(Ordering::Relaxed) % n;
            let mut failed_in_round = 0;
            loop {
                let body = tonic::body::boxed(Full::new(body.clone()));
                let req = http::Request::from_parts(parts.clone(), body);
                let err = match channels[at].clone().oneshot(req).await {
                    Ok(resp) => {
                        current.store(at, Ordering::Relaxed);
                        return Ok(resp);
                    }
                    Err(e) => e,
                };
                at = (at + 1) % n;
                failed_in_round += 1;
                if failed_in_round < n {
                    tracing::debug!(peer, error = %err, "call failed in transport; trying the next peer");
                    continue;
                }
                failed_in_round = 0;
                let now = Instant::now();
                if now + backoff > deadline {
                    let waited = if budget.is_zero() {
                        String::new()
                    } else {
                        format!(" (retried for {} ms)", budget.as_millis())
                    };
                    return Err(Box::new(tonic::Status::unavailable(format!(
                        "{peer} unreachable{waited}: {err}"
                    ))) as BoxError);
                }
                tracing::debug!(peer, error = %err, backoff_ms = backoff.as_millis() as u64, "call failed in transport; resending");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        })
    }
}
