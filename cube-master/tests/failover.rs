//! Scheduling and fail-over against in-process Node gRPC servers (test doubles for cubelet:
//! one that refuses every create, one that accepts). The real cubelet path is covered by
//! tests/e2e.

use cube_master::fleet::Nodes;
use cube_master::ops::{Controller, CreateParams};
use cube_master::state::SandboxState;
use cube_master::store::Db;
use cube_master::{MasterConfig, MasterError};
use cube_proto::nodev1 as pb;
use cube_proto::nodev1::node_server::{Node, NodeServer};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use tonic::{Request, Response, Status};

#[derive(Default)]
struct FakeNode {
    id: String,
    fail_create: bool,
    /// A create takes this long (a master can die meanwhile).
    create_delay_ms: u64,
    max: u32,
    creates: AtomicU32,
    kills: AtomicU32,
}

type R<T> = Result<Response<T>, Status>;

/// The served handle; the test keeps another `Arc` to read the counters.
struct Handle(Arc<FakeNode>);

impl std::ops::Deref for Handle {
    type Target = FakeNode;
    fn deref(&self) -> &FakeNode {
        &self.0
    }
}

#[tonic::async_trait]
impl Node for Handle {
    async fn set_end_time(
        &self,
        _r: Request<pb::SetEndTimeRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn create_sandbox(&self, r: Request<pb::CreateSandboxRequest>) -> R<pb::Sandbox> {
        self.creates.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(std::time::Duration::from_millis(self.create_delay_ms)).await;
        if self.fail_create {
            return Err(Status::internal("disk clone failed"));
        }
        let r = r.into_inner();
        assert!(
            !r.access_token.is_empty(),
            "the master must send an access token"
        );
        Ok(Response::new(pb::Sandbox {
            sandbox_id: r.sandbox_id,
            template: r.template,
            build: "b1".into(),
            state: pb::SandboxState::Running as i32,
            runtime: "namespace".into(),
            // Nothing listens here: the envd version falls back to the configured default.
            agent_address: "127.0.0.1:1".into(),
            ..Default::default()
        }))
    }
    async fn kill_sandbox(&self, _r: Request<pb::SandboxRef>) -> R<pb::KillSandboxResponse> {
        self.kills.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(pb::KillSandboxResponse { existed: true }))
    }
    async fn pause_sandbox(&self, _r: Request<pb::PauseSandboxRequest>) -> R<pb::Sandbox> {
        Err(Status::unimplemented("fake"))
    }
    async fn resume_sandbox(&self, _r: Request<pb::ResumeSandboxRequest>) -> R<pb::Sandbox> {
        Err(Status::unimplemented("fake"))
    }
    async fn snapshot_sandbox(
        &self,
        _r: Request<pb::SnapshotSandboxRequest>,
    ) -> R<pb::SnapshotSandboxResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn list_sandboxes(
        &self,
        _r: Request<pb::ListSandboxesRequest>,
    ) -> R<pb::ListSandboxesResponse> {
        Ok(Response::new(pb::ListSandboxesResponse::default()))
    }
    async fn get_sandbox(&self, _r: Request<pb::SandboxRef>) -> R<pb::Sandbox> {
        Err(Status::not_found("fake"))
    }
    async fn list_templates(
        &self,
        _r: Request<pb::ListTemplatesRequest>,
    ) -> R<pb::ListTemplatesResponse> {
        Ok(Response::new(pb::ListTemplatesResponse::default()))
    }
    async fn import_template(&self, _r: Request<pb::ImportTemplateRequest>) -> R<pb::Template> {
        Err(Status::unimplemented("fake"))
    }
    async fn delete_template(
        &self,
        _r: Request<pb::DeleteTemplateRequest>,
    ) -> R<pb::DeleteTemplateResponse> {
        Err(Status::unimplemented("fake"))
    }
    type BuildTemplateStream = std::pin::Pin<
        Box<dyn futures_core::Stream<Item = Result<pb::TemplateBuildEvent, Status>> + Send>,
    >;
    async fn build_template(
        &self,
        _r: Request<pb::ImportTemplateRequest>,
    ) -> R<Self::BuildTemplateStream> {
        Err(Status::unimplemented("fake"))
    }
    async fn sandbox_stats(&self, _r: Request<pb::SandboxRef>) -> R<pb::SandboxStatsResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn node_status(&self, _r: Request<pb::NodeStatusRequest>) -> R<pb::NodeStatusResponse> {
        Ok(Response::new(pb::NodeStatusResponse {
            node_id: self.id.clone(),
            runtime: "namespace".into(),
            templates: vec!["base".into()],
            capacity: Some(pb::Capacity {
                max_sandboxes: self.max,
                ..Default::default()
            }),
            ..Default::default()
        }))
    }
    async fn set_egress(&self, _r: Request<pb::SetEgressRequest>) -> R<pb::Sandbox> {
        Err(Status::unimplemented("fake"))
    }
    async fn sandbox_metrics(
        &self,
        _r: Request<pb::SandboxMetricsRequest>,
    ) -> R<pb::SandboxMetricsResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn sandbox_logs(
        &self,
        _r: Request<pb::SandboxLogsRequest>,
    ) -> R<pb::SandboxLogsResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn guest_health(&self, _r: Request<pb::SandboxRef>) -> R<pb::GuestHealthResponse> {
        Err(Status::unimplemented("fake"))
    }
}

async fn serve(n: Arc<FakeNode>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeServer::new(Handle(n)))
            .serve_with_incoming(tokio_stream_wrapper(l)),
    );
    format!("http://{addr}")
}

fn tokio_stream_wrapper(
    l: tokio::net::TcpListener,
) -> impl futures_core::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(l, |l| async move {
        let r = l.accept().await.map(|(s, _)| s);
        Some((r, l))
    })
}

async fn controller(nodes: &[String]) -> (Controller, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    (controller_on(nodes, dir.path()).await, dir)
}

/// A master on the database in `dir` (a second one there is the first one restarted).
async fn controller_on(nodes: &[String], dir: &std::path::Path) -> Controller {
    let db = Db::open(&format!("sqlite://{}/m.db?mode=rwc", dir.display()))
        .await
        .unwrap();
    let ns = Nodes::new(nodes, 2).unwrap();
    ns.poll_once().await;
    let cfg = MasterConfig {
        nodes: nodes.to_vec(),
        ..Default::default()
    };
    Controller::new(cfg, db, ns)
}

fn params() -> CreateParams {
    CreateParams {
        team_id: "t".into(),
        template: "base".into(),
        timeout_s: 60,
        ..Default::default()
    }
}

#[tokio::test]
async fn create_fails_over_to_the_next_node() {
    // The failing node has more free capacity, so it is tried first.
    let bad = Arc::new(FakeNode {
        id: "bad".into(),
        fail_create: true,
        max: 100,
        ..Default::default()
    });
    let good = Arc::new(FakeNode {
        id: "good".into(),
        max: 10,
        ..Default::default()
    });
    let addrs = vec![serve(bad.clone()).await, serve(good.clone()).await];
    let (ctl, _d) = controller(&addrs).await;
    let row = ctl.create(params()).await.unwrap();
    assert_eq!(row.node_id, "good");
    assert_eq!(row.state, SandboxState::Running);
    assert_eq!(row.envd_version, "0.6.4");
    assert_eq!(bad.creates.load(Ordering::SeqCst), 1);
    // Whatever the failing node half-made is cleaned up there.
    assert_eq!(bad.kills.load(Ordering::SeqCst), 1);
    assert_eq!(good.creates.load(Ordering::SeqCst), 1);
    assert_eq!(
        ctl.get("t", &row.id).await.unwrap().state,
        SandboxState::Running
    );
    // Another team does not see it.
    assert!(matches!(
        ctl.get("u", &row.id).await,
        Err(MasterError::NotFound(_))
    ));
    assert!(ctl.kill("t", &row.id, "test").await.unwrap());
    assert!(!ctl.kill("t", &row.id, "test").await.unwrap());
    assert_eq!(good.kills.load(Ordering::SeqCst), 1);
}

/// A master that dies mid-create leaves a `creating` row and the idempotency key held by it.
/// The restarted master fails that row at start, and the client's retry under the same key
/// becomes a new create instead of waiting for one that will never end.
#[tokio::test]
async fn a_create_cut_short_by_the_masters_end_is_failed_and_its_retry_goes_ahead() {
    let node = Arc::new(FakeNode {
        id: "n".into(),
        max: 10,
        create_delay_ms: 2_000,
        ..Default::default()
    });
    let addrs = vec![serve(node.clone()).await];
    let dir = tempfile::tempdir().unwrap();
    let keyed = || CreateParams {
        idempotency_key: "retry-me".into(),
        ..params()
    };
    let first = controller_on(&addrs, dir.path()).await;
    // The master "dies": its create is dropped while the node is still creating.
    let cut = tokio::time::timeout(std::time::Duration::from_millis(500), first.create(keyed()));
    assert!(cut.await.is_err(), "the slow create finished early");
    let stuck = first
        .db
        .list_in_states(&[cube_master::state::SandboxState::Creating])
        .await
        .unwrap();
    assert_eq!(stuck.len(), 1);
    drop(first);

    let second = controller_on(&addrs, dir.path()).await;
    assert_eq!(second.fail_interrupted_creates().await.unwrap(), 1);
    assert_eq!(second.fail_interrupted_creates().await.unwrap(), 0);
    let row = second.db.get_sandbox(&stuck[0].id).await.unwrap().unwrap();
    assert_eq!(row.state, SandboxState::Failed);
    assert_eq!(row.reason, cube_master::ops::sandboxes::INTERRUPTED_CREATE);
    // The retry: a new sandbox, promptly (not after the replay's wait for the dead create).
    let t = std::time::Instant::now();
    let again = second.create(keyed()).await.unwrap();
    assert_ne!(again.id, stuck[0].id);
    assert_eq!(again.state, SandboxState::Running);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
    // And the key now answers with that one.
    assert_eq!(second.create(keyed()).await.unwrap().id, again.id);
    assert_eq!(node.creates.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn all_nodes_failing_leaves_a_failed_row_and_an_error() {
    let bad = Arc::new(FakeNode {
        id: "bad".into(),
        fail_create: true,
        max: 10,
        ..Default::default()
    });
    let addrs = vec![serve(bad.clone()).await];
    let (ctl, _d) = controller(&addrs).await;
    let e = ctl.create(params()).await.unwrap_err();
    assert!(e.to_string().contains("disk clone failed"), "{e}");
    let (live, _) = ctl.list(Default::default()).await.unwrap();
    assert!(live.is_empty());
    let failed = ctl
        .db
        .list_in_states(&[cube_master::state::SandboxState::Failed])
        .await
        .unwrap();
    assert_eq!(failed.len(), 1);
    assert!(failed[0].reason.contains("disk clone failed"));
    // Unknown template and bad timeouts never reach a node.
    let mut p = params();
    p.template = "nope".into();
    assert!(matches!(ctl.create(p).await, Err(MasterError::NotFound(_))));
    let mut p = params();
    p.timeout_s = 0;
    assert!(matches!(
        ctl.create(p).await,
        Err(MasterError::InvalidArgument(_))
    ));
    assert_eq!(bad.creates.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn unreachable_node_is_not_ready() {
    // Held for this process and never listened on.
    let addr = format!("http://127.0.0.1:{}", cube_testkit::reserve_port());
    let (ctl, _d) = controller(&[addr]).await;
    ctl.nodes.poll_once().await;
    assert!(ctl.nodes.snapshot().iter().all(|n| !n.ready));
    assert!(matches!(
        ctl.create(params()).await,
        Err(MasterError::Unavailable(_))
    ));
}

#[tokio::test]
async fn node_goes_not_ready_after_misses_and_back() {
    let n = Arc::new(FakeNode {
        id: "flaky".into(),
        max: 10,
        ..Default::default()
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let addr = format!("http://127.0.0.1:{port}");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let srv = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeServer::new(Handle(n.clone())))
            .serve_with_incoming_shutdown(tokio_stream_wrapper(l), async {
                let _ = rx.await;
            }),
    );
    let (ctl, _d) = controller(std::slice::from_ref(&addr)).await;
    assert!(ctl.nodes.snapshot()[0].ready);
    let _ = tx.send(());
    let _ = srv.await;
    // max_misses = 2: one miss keeps it ready, the second marks it NotReady.
    ctl.nodes.poll_once().await;
    assert!(ctl.nodes.snapshot()[0].ready);
    ctl.nodes.poll_once().await;
    assert!(!ctl.nodes.snapshot()[0].ready);
    assert!(matches!(
        ctl.create(params()).await,
        Err(MasterError::Unavailable(_))
    ));
    // Back on the same address: ready again after one good poll.
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeServer::new(Handle(n.clone())))
            .serve_with_incoming(tokio_stream_wrapper(l)),
    );
    let mut ok = false;
    for _ in 0..50 {
        ctl.nodes.poll_once().await;
        if ctl.nodes.snapshot()[0].ready {
            ok = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(ok, "node did not come back");
    assert_eq!(ctl.create(params()).await.unwrap().node_id, "flaky");
}
