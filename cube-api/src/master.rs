//! The cube-master gRPC client, which rides out a master restart.
//!
//! Every call cube-api makes is safe to send twice: reads and kills are idempotent, and a create
//! carries an idempotency key (the client's, or one cube-api makes up), so the master answers a
//! resent create with the sandbox of the first. So a call that fails in transport (connection
//! refused or reset: the master is restarting) is resent with a backoff until a time budget is
//! spent, and only then fails, as `Unavailable`.

use bytes::Bytes;
use cube_proto::master::v1::master_client::MasterClient;
use http_body_util::{BodyExt, Full};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tonic::body::BoxBody;
use tonic::transport::Channel;
use tower::ServiceExt;

pub type Master = MasterClient<Retrying>;

/// First wait before a resend; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A client on `channel` that resends a call failing in transport for up to `budget`
/// (`Duration::ZERO`: one try).
pub fn client(channel: Channel, budget: Duration) -> Master {
    MasterClient::new(Retrying { channel, budget })
}

/// The channel under [`Master`]: buffers each request (all are unary) so it can be sent again.
#[derive(Clone)]
pub struct Retrying {
    channel: Channel,
    budget: Duration,
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
        let channel = self.channel.clone();
        let budget = self.budget;
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body: Bytes = body.collect().await.map_err(Box::new)?.to_bytes();
            let deadline = Instant::now() + budget;
            let mut backoff = FIRST_BACKOFF;
            loop {
                let body = tonic::body::boxed(Full::new(body.clone()));
                let req = http::Request::from_parts(parts.clone(), body);
                let err = match channel.clone().oneshot(req).await {
                    Ok(resp) => return Ok(resp),
                    Err(e) => e,
                };
                let now = Instant::now();
                if now + backoff > deadline {
                    let waited = if budget.is_zero() {
                        String::new()
                    } else {
                        format!(" (retried for {} ms)", budget.as_millis())
                    };
                    return Err(Box::new(tonic::Status::unavailable(format!(
                        "cube-master unreachable{waited}: {err}"
                    ))) as BoxError);
                }
                tracing::debug!(error = %err, backoff_ms = backoff.as_millis() as u64, "master call failed in transport; resending");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cube_proto::master::v1 as pb;

    /// A port nothing listens on: bound, then closed.
    fn closed_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    fn channel(port: u16) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(1))
            .connect_lazy()
    }

    #[tokio::test]
    async fn an_unreachable_master_is_unavailable_once_the_budget_is_spent() {
        let port = closed_port();
        let mut once = client(channel(port), Duration::ZERO);
        let t = std::time::Instant::now();
        let e = once
            .get_sandbox(pb::SandboxRef::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        assert!(e.message().contains("cube-master unreachable"), "{e}");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "one try only: {:?}",
            t.elapsed()
        );

        let mut retrying = client(channel(port), Duration::from_millis(600));
        let t = std::time::Instant::now();
        let e = retrying
            .get_sandbox(pb::SandboxRef::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        assert!(e.message().contains("retried for 600 ms"), "{e}");
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(300),
            "it kept trying: {took:?}"
        );
        assert!(
            took < Duration::from_secs(3),
            "and stopped at its budget: {took:?}"
        );
    }
}
