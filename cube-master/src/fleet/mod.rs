//! The nodes the master schedules onto, in memory: static ones from the config (health from a
//! periodic NodeStatus poll, NotReady after `node_max_misses` failures in a row) and registered
//! ones (health from heartbeats, NotReady after `node_max_misses` heartbeat intervals without
//! one). What must survive a restart (identity, cordon, secret hash) is in the `nodes` table;
//! [`crate::ops::lifecycle`] keeps the two in step and turns health changes into sandbox states.
//! Placement itself is the pure [`scheduler`](crate::fleet::scheduler), over views of these
//! nodes.

pub mod scheduler;

use self::scheduler::{NoFit, NodeView};
use cube_proto::nodev1::node_client::NodeClient;
use cube_proto::nodev1::{Capacity, NodeStatusRequest, NodeStatusResponse};
use cube_proto::retry::Retrying;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// Where a node came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Static,
    Registered,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Static => "static",
            Origin::Registered => "registered",
        }
    }
}

/// Health as far as the master knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Not heard from yet since this master started (within the grace period).
    Unknown,
    Ready,
    NotReady,
}

#[derive(Clone, Debug)]
pub struct Node {
    /// gRPC address the master uses (from the config or the registration).
    pub address: String,
    /// For sandbox operations: resends a call that fails in transport for up to
    /// [`NODE_RETRY`], so a cubelet restart is a short wait, not a failed operation.
    pub client: NodeClient<Retrying>,
    /// For status polls: one try, so a node that went away is noticed at once.
    pub probe: NodeClient<Channel>,
    /// The latest view of the node: its NodeStatus answer (static) or one built from its
    /// registration and heartbeats (registered).
    pub status: Option<NodeStatusResponse>,
    pub misses: u32,
    /// `health == Ready`, kept as a field for callers that only need the bit.
    pub ready: bool,
    pub health: Health,
    /// The last health [`crate::ops::lifecycle`] acted on (marking sandboxes lost, reconciling).
    pub handled: Health,
    /// When its sandboxes were last reconciled completely (unix ms; 0 = not yet).
    pub reconciled_ms: i64,
    pub origin: Origin,
    pub cordoned: bool,
    /// Known id (registered nodes; static nodes once they answered or from the database).
    pub node_id: String,
    pub last_seen_ms: i64,
    /// Last time `last_seen_ms` was written to the database.
    pub persisted_seen_ms: i64,
    /// MemAvailable reported in heartbeats, MiB (0 = unknown).
    pub free_memory_mib: u64,
    /// Creates sent to this node that its reported count does not include yet.
    pub inflight: u32,
    /// When creates finished on this node since its count was last measured: without them,
    /// creates faster than the status poll would all see the same counts and pile onto one node.
    pub placed_ms: Vec<i64>,
    /// Templates with ready pool entries (warm starts).
    pub warm_templates: Vec<String>,
    /// SHA-256 of the registered node's secret (empty for static nodes).
    pub secret_sha256: String,
    /// Static nodes: whether the database has a row for the id it reported.
    pub db_synced: bool,
}

/// How long a sandbox operation keeps resending to a node that refuses or drops connections:
/// longer than a cubelet restart (about 2 s), shorter than a client's patience. Every node call
/// is safe to send twice: kills are idempotent, and a create names its sandbox, which the node
/// either answers with (made already, or re-adopted after a restart) or, restarted, has reaped
/// half-made and makes anew.
pub const NODE_RETRY: Duration = Duration::from_secs(5);

type Clients = (NodeClient<Retrying>, NodeClient<Channel>);

fn client_for(address: &str) -> Result<Clients, crate::MasterError> {
    // Over mutual TLS when the master's `[tls]` is set (cube_proto::tls::set_process_tls).
    let ep = cube_proto::tls::client_endpoint(address)
        .map_err(|e| crate::MasterError::InvalidArgument(format!("node address {address:?}: {e}")))?
        .connect_timeout(Duration::from_secs(2));
    let ch = ep.connect_lazy();
    Ok((
        NodeClient::new(Retrying::new(ch.clone(), NODE_RETRY, "node")),
        NodeClient::new(ch),
    ))
}

/// A registered node's status from its registration; what only its heartbeats report (free
/// disk, sandbox count, templates) is kept from `prev`, or empty until the first.
fn registered_status(r: &Registration, prev: Option<&NodeStatusResponse>) -> NodeStatusResponse {
    NodeStatusResponse {
        node_id: r.node_id.clone(),
        version: r.version.clone(),
        runtime: r.runtime.clone(),
        kvm_kind: r.kvm_kind.clone(),
        capacity: Some(Capacity {
            vcpus: r.vcpus,
            memory_mib: r.memory_mib,
            disk_free_mib: prev
                .and_then(|p| p.capacity.as_ref())
                .map(|c| c.disk_free_mib)
                .unwrap_or(0),
            max_sandboxes: r.max_sandboxes,
        }),
        sandboxes: prev.map(|p| p.sandboxes).unwrap_or(0),
        templates: prev.map(|p| p.templates.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

/// Checks a node's gRPC address without connecting.
pub fn check_address(address: &str) -> Result<(), crate::MasterError> {
    if !(address.starts_with("http://") || address.starts_with("https://")) {
        return Err(crate::MasterError::InvalidArgument(format!(
            "node address {address:?} must be an http:// or https:// URL"
        )));
    }
    Endpoint::from_shared(address.to_string())
        .map(|_| ())
        .map_err(|e| crate::MasterError::InvalidArgument(format!("node address {address:?}: {e}")))
}

impl Node {
    fn new(address: &str, origin: Origin) -> Result<Node, crate::MasterError> {
        let (client, probe) = client_for(address)?;
        Ok(Node {
            address: address.to_string(),
            client,
            probe,
            status: None,
            misses: 0,
            ready: false,
            health: Health::Unknown,
            handled: Health::Unknown,
            reconciled_ms: 0,
            origin,
            cordoned: false,
            node_id: String::new(),
            last_seen_ms: 0,
            persisted_seen_ms: 0,
            free_memory_mib: 0,
            inflight: 0,
            placed_ms: Vec::new(),
            warm_templates: Vec::new(),
            secret_sha256: String::new(),
            db_synced: false,
        })
    }

    /// A registered node as its registration describes it (health Unknown, seen now).
    fn registered(r: &Registration, now_ms: i64) -> Result<Node, crate::MasterError> {
        let mut n = Node::new(&r.address, Origin::Registered)?;
        n.node_id = r.node_id.clone();
        n.status = Some(registered_status(r, None));
        n.secret_sha256 = r.secret_sha256.clone();
        n.cordoned = r.cordoned;
        n.last_seen_ms = now_ms;
        n.persisted_seen_ms = now_ms;
        Ok(n)
    }

    /// The node's id: known id, else the id it reports, else its address.
    pub fn id(&self) -> String {
        if !self.node_id.is_empty() {
            return self.node_id.clone();
        }
        self.status
            .as_ref()
            .map(|s| s.node_id.clone())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| self.address.clone())
    }

    fn set_health(&mut self, h: Health) {
        self.health = h;
        self.ready = h == Health::Ready;
    }

    /// The scheduler's view of this node.
    pub fn view(&self) -> NodeView<'_> {
        const EMPTY: &[String] = &[];
        let (sandboxes, max, total, templates) = match &self.status {
            Some(s) => (
                s.sandboxes,
                s.capacity.as_ref().map(|c| c.max_sandboxes).unwrap_or(0),
                s.capacity.as_ref().map(|c| c.memory_mib).unwrap_or(0),
                s.templates.as_slice(),
            ),
            None => (0, 0, 0, EMPTY),
        };
        NodeView {
            ready: self.ready && self.status.is_some(),
            cordoned: self.cordoned,
            sandboxes: sandboxes.saturating_add(self.inflight),
            recent: self.placed_ms.len() as u32,
            max_sandboxes: max,
            free_memory_mib: self.free_memory_mib,
            total_memory_mib: total,
            templates,
            warm_templates: &self.warm_templates,
        }
    }

    fn matches(&self, key: &str) -> bool {
        !key.is_empty() && (self.address == key || self.id() == key)
    }
}

/// What a registration tells the master about a node.
#[derive(Clone, Debug, Default)]
pub struct Registration {
    pub node_id: String,
    pub address: String,
    pub version: String,
    pub runtime: String,
    pub kvm_kind: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub max_sandboxes: u32,
    pub cordoned: bool,
    pub secret_sha256: String,
}

/// What a heartbeat tells the master.
#[derive(Clone, Debug, Default)]
pub struct Beat {
    pub sandboxes: u32,
    pub templates: Vec<String>,
    pub disk_free_mib: u64,
    pub free_memory_mib: u64,
}

/// Nodes that can take a sandbox of `template`, best first (a convenience over
/// [`scheduler::rank`] for callers holding a node list).
pub fn candidates(nodes: &[Node], template: &str) -> Result<Vec<Node>, NoFit> {
    let views: Vec<NodeView<'_>> = nodes.iter().map(Node::view).collect();
    let order = scheduler::rank(
        &views,
        &scheduler::Request {
            template,
            memory_mib: 0,
        },
    )?;
    Ok(order.into_iter().map(|i| nodes[i].clone()).collect())
}

/// Nodes a create tries at most (the best first, then fail-over to the next ones).
pub const MAX_CANDIDATES: usize = 8;

#[derive(Clone)]
pub struct Nodes {
    inner: Arc<RwLock<Vec<Node>>>,
    max_misses: u32,
    heartbeat_interval_ms: u64,
}

/// Decrements a node's in-flight create count when the create is over.
pub struct Inflight {
    nodes: Nodes,
    address: String,
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.nodes
            .update(&self.address, |n| n.inflight = n.inflight.saturating_sub(1));
    }
}

impl Nodes {
    /// Static nodes from the config.
    pub fn new(addresses: &[String], max_misses: u32) -> Result<Nodes, crate::MasterError> {
        let mut v = Vec::new();
        for a in addresses {
            v.push(Node::new(a, Origin::Static)?);
        }
        Ok(Nodes {
            inner: Arc::new(RwLock::new(v)),
            max_misses: max_misses.max(1),
            heartbeat_interval_ms: 2000,
        })
    }

    /// Sets the heartbeat interval registered nodes are told to use.
    pub fn with_heartbeat_interval(mut self, ms: u64) -> Nodes {
        self.heartbeat_interval_ms = ms.max(10);
        self
    }

    pub fn heartbeat_interval_ms(&self) -> u64 {
        self.heartbeat_interval_ms
    }

    /// How long a registered node may stay silent before it is NotReady.
    pub fn heartbeat_timeout_ms(&self) -> i64 {
        (self.heartbeat_interval_ms * self.max_misses as u64) as i64
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Node>> {
        match self.inner.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Node>> {
        match self.inner.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    pub fn snapshot(&self) -> Vec<Node> {
        self.read().clone()
    }

    /// The node with this id or address.
    pub fn find(&self, key: &str) -> Option<Node> {
        self.read().iter().find(|n| n.matches(key)).cloned()
    }

    /// Applies `f` to the node with this id or address; returns its result.
    pub fn update<T>(&self, key: &str, f: impl FnOnce(&mut Node) -> T) -> Option<T> {
        self.write().iter_mut().find(|n| n.matches(key)).map(f)
    }

    /// Records a create that finished on the node `key`, until its reported count includes it.
    pub fn placed(&self, key: &str) {
        let now = crate::now_ms();
        self.update(key, |n| {
            // Bounded even if the node stops reporting.
            n.placed_ms.retain(|&t| t > now - 30_000);
            n.placed_ms.push(now);
        });
    }

    /// Ranks the nodes for a sandbox of `template` and returns them best first, counting
    /// the create as in flight on the first one (so that concurrent creates spread).
    pub fn place(
        &self,
        template: &str,
        memory_mib: u64,
    ) -> Result<(Vec<Node>, Option<Inflight>), NoFit> {
        let mut g = self.write();
        let order = {
            let views: Vec<NodeView<'_>> = g.iter().map(Node::view).collect();
            scheduler::rank(
                &views,
                &scheduler::Request {
                    template,
                    memory_mib,
                },
            )?
        };
        let first = order[0];
        g[first].inflight += 1;
        let guard = Inflight {
            nodes: self.clone(),
            address: g[first].address.clone(),
        };
        Ok((
            order
                .into_iter()
                .take(MAX_CANDIDATES)
                .map(|i| g[i].clone())
                .collect(),
            Some(guard),
        ))
    }

    /// Adds or updates a registered node (a new address gets a new client).
    pub fn register(&self, r: &Registration, now_ms: i64) -> Result<(), crate::MasterError> {
        let mut g = self.write();
        if let Some(n) = g.iter_mut().find(|n| n.node_id == r.node_id) {
            if n.address != r.address {
                (n.client, n.probe) = client_for(&r.address)?;
                n.address = r.address.clone();
            }
            n.status = Some(registered_status(r, n.status.as_ref()));
            n.secret_sha256 = r.secret_sha256.clone();
            n.last_seen_ms = now_ms;
            n.misses = 0;
            n.set_health(Health::Ready);
            return Ok(());
        }
        let mut n = Node::registered(r, now_ms)?;
        n.set_health(Health::Ready);
        g.push(n);
        Ok(())
    }

    /// Loads a registered node from the database at start: Unknown, with one heartbeat
    /// timeout of grace before it counts as NotReady.
    pub fn load_registered(&self, r: &Registration, now_ms: i64) -> Result<(), crate::MasterError> {
        let mut g = self.write();
        if g.iter().any(|n| n.node_id == r.node_id) {
            return Ok(());
        }
        g.push(Node::registered(r, now_ms)?);
        Ok(())
    }

    /// Records a heartbeat; `None` when the node is not known (it should register again).
    /// Returns (cordoned, seen time last persisted).
    pub fn heartbeat(&self, node_id: &str, b: &Beat, now_ms: i64) -> Option<(bool, i64)> {
        let mut g = self.write();
        let n = g
            .iter_mut()
            .find(|n| n.origin == Origin::Registered && n.node_id == node_id)?;
        let st = n.status.get_or_insert_with(|| NodeStatusResponse {
            node_id: node_id.to_string(),
            ..Default::default()
        });
        // The reported count now includes what was in flight when it was measured.
        if b.sandboxes != st.sandboxes {
            n.inflight = 0;
        }
        st.sandboxes = b.sandboxes;
        // Counted by the node just before it sent the beat.
        n.placed_ms.retain(|&t| t > now_ms - 50);
        st.templates = b.templates.clone();
        st.capacity
            .get_or_insert_with(Default::default)
            .disk_free_mib = b.disk_free_mib;
        n.free_memory_mib = b.free_memory_mib;
        n.last_seen_ms = now_ms;
        n.misses = 0;
        n.set_health(Health::Ready);
        Some((n.cordoned, n.persisted_seen_ms))
    }

    /// Marks registered nodes silent for longer than the heartbeat timeout NotReady.
    pub fn expire(&self, now_ms: i64) {
        let timeout = self.heartbeat_timeout_ms();
        for n in self.write().iter_mut() {
            if n.origin == Origin::Registered
                && n.health != Health::NotReady
                && now_ms - n.last_seen_ms > timeout
            {
                tracing::warn!(node = %n.node_id, silent_ms = now_ms - n.last_seen_ms, "node missed its heartbeats: not ready");
                n.set_health(Health::NotReady);
            }
        }
    }

    /// Polls every static node once.
    pub async fn poll_once(&self) {
        let statics: Vec<Node> = self
            .read()
            .iter()
            .filter(|n| n.origin == Origin::Static)
            .cloned()
            .collect();
        let polled_at = crate::now_ms();
        let polls = statics.into_iter().map(|n| async move {
            let mut c = n.probe.clone();
            let r =
                tokio::time::timeout(Duration::from_secs(2), c.node_status(NodeStatusRequest {}))
                    .await;
            let res = match r {
                Ok(Ok(s)) => Ok(s.into_inner()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("NodeStatus timed out".to_string()),
            };
            (n.address, res)
        });
        let results = futures_util::future::join_all(polls).await;
        let now = crate::now_ms();
        let mut g = self.write();
        for (address, res) in results {
            let Some(e) = g
                .iter_mut()
                .find(|e| e.origin == Origin::Static && e.address == address)
            else {
                continue;
            };
            match res {
                Ok(s) => {
                    if !e.ready {
                        tracing::info!(node = %address, id = %s.node_id, "node ready");
                    }
                    if !s.node_id.is_empty() {
                        e.node_id = s.node_id.clone();
                    }
                    e.warm_templates = s
                        .pools
                        .iter()
                        .filter(|p| p.ready > 0 && !p.template.is_empty())
                        .map(|p| p.template.clone())
                        .collect();
                    // NodeStatus reports totals and promised shapes, not what is really
                    // available (sandboxes rarely use their whole shape): unknown, not filtered.
                    e.free_memory_mib = 0;
                    if s.sandboxes != e.status.as_ref().map(|p| p.sandboxes).unwrap_or(u32::MAX) {
                        e.inflight = 0;
                    }
                    e.status = Some(s);
                    // Creates that finished before the poll was sent are in its count.
                    e.placed_ms.retain(|&t| t >= polled_at);
                    e.misses = 0;
                    e.last_seen_ms = now;
                    e.set_health(Health::Ready);
                }
                Err(msg) => {
                    e.misses += 1;
                    if e.misses >= self.max_misses && e.health != Health::NotReady {
                        tracing::warn!(node = %address, %msg, "node not ready");
                        e.set_health(Health::NotReady);
                    } else {
                        tracing::debug!(node = %address, %msg, "node poll failed");
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
