//! The nodes the master schedules onto: static addresses from the config, health from a
//! periodic NodeStatus poll (NotReady after `node_max_misses` failures in a row).

use cube_proto::nodev1::node_client::NodeClient;
use cube_proto::nodev1::{NodeStatusRequest, NodeStatusResponse};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

#[derive(Clone, Debug)]
pub struct Node {
    /// gRPC address from the config; also the node's key in the database.
    pub address: String,
    pub client: NodeClient<Channel>,
    pub status: Option<NodeStatusResponse>,
    pub misses: u32,
    pub ready: bool,
}

impl Node {
    /// The id the node reports, or its address before the first answer.
    pub fn id(&self) -> String {
        self.status
            .as_ref()
            .map(|s| s.node_id.clone())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| self.address.clone())
    }
}

#[derive(Clone)]
pub struct Nodes {
    inner: Arc<RwLock<Vec<Node>>>,
    max_misses: u32,
}

impl Nodes {
    pub fn new(addresses: &[String], max_misses: u32) -> Result<Nodes, crate::MasterError> {
        let mut v = Vec::new();
        for a in addresses {
            let ep = Endpoint::from_shared(a.clone())
                .map_err(|e| crate::MasterError::InvalidArgument(format!("node {a}: {e}")))?
                .connect_timeout(Duration::from_secs(2));
            v.push(Node {
                address: a.clone(),
                client: NodeClient::new(ep.connect_lazy()),
                status: None,
                misses: 0,
                ready: false,
            });
        }
        Ok(Nodes {
            inner: Arc::new(RwLock::new(v)),
            max_misses: max_misses.max(1),
        })
    }

    pub fn snapshot(&self) -> Vec<Node> {
        self.inner.read().map(|v| v.clone()).unwrap_or_default()
    }

    /// The node with this id or address.
    pub fn find(&self, key: &str) -> Option<Node> {
        self.snapshot()
            .into_iter()
            .find(|n| n.address == key || n.id() == key)
    }

    /// Polls every node once.
    pub async fn poll_once(&self) {
        for n in self.snapshot() {
            let mut c = n.client.clone();
            let r =
                tokio::time::timeout(Duration::from_secs(2), c.node_status(NodeStatusRequest {}))
                    .await;
            let res = match r {
                Ok(Ok(s)) => Ok(s.into_inner()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("NodeStatus timed out".to_string()),
            };
            if let Ok(mut v) = self.inner.write() {
                if let Some(e) = v.iter_mut().find(|e| e.address == n.address) {
                    match res {
                        Ok(s) => {
                            if !e.ready {
                                tracing::info!(node = %n.address, id = %s.node_id, "node ready");
                            }
                            e.status = Some(s);
                            e.misses = 0;
                            e.ready = true;
                        }
                        Err(msg) => {
                            e.misses += 1;
                            if e.ready && e.misses >= self.max_misses {
                                tracing::warn!(node = %n.address, %msg, "node not ready");
                                e.ready = false;
                            } else {
                                tracing::debug!(node = %n.address, %msg, "node poll failed");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Polls forever.
    pub async fn run_poller(self, interval: Duration) {
        loop {
            self.poll_once().await;
            tokio::time::sleep(interval).await;
        }
    }
}
