//! Registration with cube-master (`[master]` in the config): register at start, heartbeat at
//! the interval the master asks for, register again when the master says it does not know the
//! node. The master being away is logged, never fatal: the node keeps serving and retries.
//!
//! The node secret the master hands out is kept in `<data_dir>/master-link.json` (versioned and
//! checksummed), so a restarted cubelet re-registers without a new one-time join token.

use crate::node::Node;
use cube_proto::master::v1 as mpb;
use cube_proto::master::v1::master_client::MasterClient;
use cube_proto::nodev1 as pb;
use cube_proto::retry::Retrying;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const LINK_FILE: &str = "master-link.json";
const LINK_FORMAT: &str = "cube-master-link";
const LINK_VERSION: u32 = 1;
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The persisted registration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Link {
    pub format: String,
    pub version: u32,
    pub node_id: String,
    pub master: String,
    pub secret: String,
    /// SHA-256 over the other fields (see [`Link::digest`]).
    pub sha256: String,
}

impl Link {
    fn digest(node_id: &str, master: &str, secret: &str) -> String {
        let mut h = Sha256::new();
        let version = LINK_VERSION.to_string();
        for part in [LINK_FORMAT, version.as_str(), node_id, master, secret] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        format!("{:x}", h.finalize())
    }

    pub fn new(node_id: &str, master: &str, secret: &str) -> Link {
        Link {
            format: LINK_FORMAT.into(),
            version: LINK_VERSION,
            node_id: node_id.into(),
            master: master.into(),
            secret: secret.into(),
            sha256: Link::digest(node_id, master, secret),
        }
    }

    /// Reads the link file; `Ok(None)` when absent. A damaged or foreign file is an error
    /// (the caller logs it and registers with the join token instead).
    pub fn load(path: &Path) -> Result<Option<Link>, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        let l: Link =
            serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", path.display()))?;
        if l.format != LINK_FORMAT || l.version != LINK_VERSION {
            return Err(format!(
                "{}: unsupported format {:?} version {}",
                path.display(),
                l.format,
                l.version
            ));
        }
        if l.sha256 != Link::digest(&l.node_id, &l.master, &l.secret) {
            return Err(format!("{}: checksum mismatch", path.display()));
        }
        Ok(Some(l))
    }

    /// Writes atomically (temp file + rename), readable by root only.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("json.tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(serde_json::to_string_pretty(self)?.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    }
}

/// The gRPC URL the master should use for this node.
pub fn advertise_url(advertise: &str, grpc_addr: &str) -> String {
    if !advertise.trim().is_empty() {
        return advertise.trim().to_string();
    }
    match grpc_addr.parse::<std::net::SocketAddr>() {
        Ok(sa) if sa.ip().is_unspecified() => format!("http://127.0.0.1:{}", sa.port()),
        Ok(sa) => format!("http://{sa}"),
        Err(_) => format!("http://{grpc_addr}"),
    }
}

fn mem_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(0)
}

/// Starts the registration loop when `[master] address` (or `addresses`) is set.
pub fn spawn(node: Arc<Node>) -> Option<tokio::task::JoinHandle<()>> {
    if node.host.cfg.master.masters().is_empty() {
        return None;
    }
    Some(tokio::spawn(run(node)))
}

/// Counts failures so that an absent master is logged at first and then only now and then.
struct Quiet {
    failures: u32,
}

impl Quiet {
    fn fail(&mut self, what: &str, err: &dyn std::fmt::Display) {
        self.failures += 1;
        if self.failures == 1 || self.failures.is_multiple_of(30) {
            tracing::warn!(failures = self.failures, error = %err, "master {what} failed; retrying");
        } else {
            tracing::debug!(error = %err, "master {what} failed");
        }
    }

    fn ok(&mut self, what: &str) {
        if self.failures > 0 {
            tracing::info!(after_failures = self.failures, "master {what} works again");
        }
        self.failures = 0;
    }
}

async fn run(node: Arc<Node>) {
    let link_cfg = node.host.cfg.master.clone();
    let masters = link_cfg.masters();
    let mut channels = Vec::new();
    for m in &masters {
        // Over mutual TLS when `[tls]` is set (cube_proto::tls::set_process_tls in main).
        match cube_proto::tls::client_endpoint(m) {
            Ok(e) => channels.push(
                e.connect_timeout(Duration::from_secs(3))
                    .timeout(Duration::from_secs(10))
                    .connect_lazy(),
            ),
            Err(e) => {
                tracing::error!(address = %m, error = %e, "[master] address is not a URL; not registering");
                return;
            }
        }
    }
    // One try of each master per call: this loop retries by itself.
    let mut client = MasterClient::new(Retrying::over(channels, Duration::ZERO, "cube-master"));
    // The node secret is the fleet's (the masters share a database): kept under the first.
    let master = masters.join(",");
    let node_id = node.host.cfg.node_id();
    let path: PathBuf = node.host.cfg.data_dir.join(LINK_FILE);
    let advertise = advertise_url(&link_cfg.advertise, &node.host.cfg.grpc_addr);
    let mut saved = match Link::load(&path) {
        Ok(Some(l)) if l.node_id == node_id && masters.contains(&l.master) => Some(l.secret),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(error = %e, "ignoring the saved master registration");
            None
        }
    };
    let mut quiet = Quiet { failures: 0 };
    let mut backoff = Duration::from_millis(500);
    let mut session: Option<(String, Duration)> = None;
    let mut cordoned = false;
    loop {
        let (secret, interval) = match session.clone() {
            Some(s) => s,
            None => {
                match register(
                    &mut client,
                    &node,
                    &node_id,
                    &advertise,
                    &link_cfg.join_token,
                    saved.as_deref(),
                )
                .await
                {
                    Ok(r) => {
                        quiet.ok("registration");
                        backoff = Duration::from_millis(500);
                        let interval = Duration::from_millis(
                            u64::from(r.heartbeat_interval_ms).clamp(50, 60_000),
                        );
                        if let Err(e) = Link::new(&node_id, &masters[0], &r.node_secret).save(&path)
                        {
                            tracing::warn!(error = %e, file = %path.display(), "saving the node secret failed: the next start needs a new join token");
                        }
                        tracing::info!(master = %master, node = %node_id, advertise = %advertise, heartbeat_ms = interval.as_millis() as u64, "registered with the master");
                        saved = Some(r.node_secret.clone());
                        session = Some((r.node_secret, interval));
                        // Heartbeat right away: the registration carries no templates yet.
                        continue;
                    }
                    Err(e) => {
                        quiet.fail("registration", &e);
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        continue;
                    }
                }
            }
        };
        match heartbeat(&mut client, &node, &node_id, &secret).await {
            Ok(r) if r.reregister => {
                tracing::info!("the master does not know this node (any more): registering again");
                session = None;
                continue;
            }
            Ok(r) => {
                quiet.ok("heartbeat");
                if r.cordoned != cordoned {
                    cordoned = r.cordoned;
                    tracing::info!(cordoned, "master cordon state of this node");
                }
            }
            Err(s) if s.code() == tonic::Code::Unauthenticated => {
                tracing::warn!(error = %s.message(), "heartbeat refused: registering again");
                session = None;
                continue;
            }
            Err(s) => quiet.fail("heartbeat", &s),
        }
        tokio::time::sleep(interval).await;
    }
}

async fn status(node: &Arc<Node>) -> pb::NodeStatusResponse {
    use pb::node_server::Node as _;
    // The same answer the master gets from NodeStatus.
    let svc = crate::grpc::NodeService { node: node.clone() };
    match svc
        .node_status(tonic::Request::new(pb::NodeStatusRequest {}))
        .await
    {
        Ok(r) => r.into_inner(),
        Err(_) => pb::NodeStatusResponse::default(),
    }
}

async fn register(
    client: &mut MasterClient<Retrying>,
    node: &Arc<Node>,
    node_id: &str,
    advertise: &str,
    join_token: &str,
    secret: Option<&str>,
) -> Result<mpb::RegisterNodeResponse, tonic::Status> {
    let st = status(node).await;
    let cap = st.capacity.unwrap_or_default();
    let r = client
        .register_node(mpb::RegisterNodeRequest {
            node_id: node_id.to_string(),
            address: advertise.to_string(),
            join_token: join_token.to_string(),
            version: st.version,
            runtime: st.runtime,
            kvm_kind: st.kvm_kind,
            vcpus: cap.vcpus,
            memory_mib: cap.memory_mib,
            max_sandboxes: cap.max_sandboxes,
            node_secret: secret.unwrap_or_default().to_string(),
        })
        .await?;
    Ok(r.into_inner())
}

async fn heartbeat(
    client: &mut MasterClient<Retrying>,
    node: &Arc<Node>,
    node_id: &str,
    secret: &str,
) -> Result<mpb::NodeHeartbeatResponse, tonic::Status> {
    let st = status(node).await;
    let r = client
        .node_heartbeat(mpb::NodeHeartbeatRequest {
            node_id: node_id.to_string(),
            node_secret: secret.to_string(),
            sandboxes: st.sandboxes,
            templates: st.templates,
            disk_free_mib: st.capacity.map(|c| c.disk_free_mib).unwrap_or(0),
            memory_mib: mem_available_mib(),
        })
        .await?;
    Ok(r.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_round_trip_and_tamper() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(LINK_FILE);
        assert_eq!(Link::load(&p).unwrap(), None);
        let l = Link::new("n1", "http://m:9090", "s3cr3t");
        l.save(&p).unwrap();
        assert_eq!(Link::load(&p).unwrap(), Some(l.clone()));
        let mut bad = l.clone();
        bad.secret = "other".into();
        std::fs::write(&p, serde_json::to_string(&bad).unwrap()).unwrap();
        assert!(Link::load(&p).unwrap_err().contains("checksum"));
        let mut v2 = l;
        v2.version = 2;
        std::fs::write(&p, serde_json::to_string(&v2).unwrap()).unwrap();
        assert!(Link::load(&p).unwrap_err().contains("version"));
        std::fs::write(&p, "{garbage").unwrap();
        assert!(Link::load(&p).is_err());
    }

    #[test]
    fn advertise_defaults() {
        assert_eq!(advertise_url("", "0.0.0.0:9091"), "http://127.0.0.1:9091");
        assert_eq!(advertise_url("", "10.0.0.5:9091"), "http://10.0.0.5:9091");
        assert_eq!(advertise_url(" http://h:1 ", "0.0.0.0:9091"), "http://h:1");
    }
}
