//! The cube-master gRPC client.

use cube_proto::master::v1::master_client::MasterClient;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

pub type Master = MasterClient<Channel>;

/// A lazily connecting client (cube-api may start before the master).
pub fn connect(url: &str) -> anyhow::Result<Master> {
    let ep = Endpoint::from_shared(url.to_string())?.connect_timeout(Duration::from_secs(2));
    Ok(MasterClient::new(ep.connect_lazy()))
}
