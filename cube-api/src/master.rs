//! The cube-master gRPC client, which rides out a master restart.
//!
//! Every call cube-api makes is safe to send twice: reads and kills are idempotent, and a create
//! carries an idempotency key (the client's, or one cube-api makes up), so the master answers a
//! resent create with the sandbox of the first. So the client resends a call that fails in
//! transport ([`cube_proto::retry::Retrying`]), to the next master at once when there are several
//! (one leads; the standbys do not listen until they take over).

use cube_proto::master::v1::master_client::MasterClient;
use cube_proto::retry::Retrying;
use std::time::Duration;
use tonic::transport::Channel;

pub type Master = MasterClient<Retrying>;

/// A client on `channels` (every master) that resends a call failing in transport for up to
/// `budget` (`Duration::ZERO`: one try of each).
pub fn client(channels: Vec<Channel>, budget: Duration) -> Master {
    MasterClient::new(Retrying::over(channels, budget, "cube-master"))
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
        let mut once = client(vec![channel(port)], Duration::ZERO);
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

        let mut retrying = client(vec![channel(port)], Duration::from_millis(600));
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
