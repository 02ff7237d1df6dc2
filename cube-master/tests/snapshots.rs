#![allow(clippy::result_large_err)] // tonic::Status is the error type the fake node must return.
//! Snapshot, fork and template-catalog bookkeeping of the master against in-process fake
//! cubelets that really hold templates (a snapshot becomes a template on the node that took
//! it). The real cubelet path is covered by tests/e2e/test_snapshots.py.

use cube_master::fleet::Nodes;
use cube_master::ops::{Controller, CreateParams};
use cube_master::state::SandboxState;
use cube_master::store::Db;
use cube_master::{grpc, MasterConfig, MasterError};
use cube_proto::master::v1 as mpb;
use cube_proto::nodev1 as pb;
use cube_proto::nodev1::node_server::{Node, NodeServer};
use futures_util::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

#[derive(Default)]
struct FakeNode {
    id: String,
    max: u32,
    /// Template name → build, as held on this node.
    templates: Mutex<BTreeMap<String, String>>,
    /// Sandbox id → template it was created from.
    sandboxes: Mutex<BTreeMap<String, String>>,
    fail_build: bool,
    /// Advertise every held template in NodeStatus (snapshots included), as a node does once
    /// its next poll comes.
    advertise_all: std::sync::atomic::AtomicBool,
}

impl FakeNode {
    fn new(id: &str, max: u32) -> Arc<FakeNode> {
        let n = FakeNode {
            id: id.into(),
            max,
            ..Default::default()
        };
        n.templates
            .lock()
            .unwrap()
            .insert("base".into(), "b1".into());
        Arc::new(n)
    }
    fn sandboxes_of(&self, template: &str) -> usize {
        self.sandboxes
            .lock()
            .unwrap()
            .values()
            .filter(|t| *t == template)
            .count()
    }
    fn holds(&self, template: &str) -> bool {
        self.templates.lock().unwrap().contains_key(template)
    }
}

type R<T> = Result<Response<T>, Status>;

struct Handle(Arc<FakeNode>);

fn template(name: &str, build: &str, source: &str) -> pb::Template {
    pb::Template {
        name: name.into(),
        build: build.into(),
        source: source.into(),
        rootfs_bytes: 1 << 20,
        created_at_ms: 1,
        ..Default::default()
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
        let r = r.into_inner();
        // As cubelet: a snapshot only for a create the master pinned to it, and only then.
        let is_snap = self
            .0
            .templates
            .lock()
            .unwrap()
            .get(&r.template)
            .map(String::as_str)
            == Some("snapb");
        if is_snap != r.from_snapshot {
            return Err(Status::not_found(format!(
                "template {} (from_snapshot {})",
                r.template, r.from_snapshot
            )));
        }
        if !self.0.holds(&r.template) {
            return Err(Status::not_found(format!(
                "template {} not on {}",
                r.template, self.0.id
            )));
        }
        self.0
            .sandboxes
            .lock()
            .unwrap()
            .insert(r.sandbox_id.clone(), r.template.clone());
        Ok(Response::new(pb::Sandbox {
            sandbox_id: r.sandbox_id,
            template: r.template,
            build: "b1".into(),
            state: pb::SandboxState::Running as i32,
            runtime: "namespace".into(),
            agent_address: "127.0.0.1:1".into(),
            ..Default::default()
        }))
    }
    async fn kill_sandbox(&self, r: Request<pb::SandboxRef>) -> R<pb::KillSandboxResponse> {
        let existed = self
            .0
            .sandboxes
            .lock()
            .unwrap()
            .remove(&r.into_inner().sandbox_id)
            .is_some();
        Ok(Response::new(pb::KillSandboxResponse { existed }))
    }
    async fn pause_sandbox(&self, _r: Request<pb::PauseSandboxRequest>) -> R<pb::Sandbox> {
        Err(Status::unimplemented("fake"))
    }
    async fn resume_sandbox(&self, _r: Request<pb::ResumeSandboxRequest>) -> R<pb::Sandbox> {
        Err(Status::unimplemented("fake"))
    }
    async fn snapshot_sandbox(
        &self,
        r: Request<pb::SnapshotSandboxRequest>,
    ) -> R<pb::SnapshotSandboxResponse> {
        let r = r.into_inner();
        if !self.0.sandboxes.lock().unwrap().contains_key(&r.sandbox_id) {
            return Err(Status::not_found("no such sandbox"));
        }
        self.0
            .templates
            .lock()
            .unwrap()
            .insert(r.template.clone(), "snapb".into());
        Ok(Response::new(pb::SnapshotSandboxResponse {
            template: Some(template(&r.template, "snapb", "snapshot")),
            filesystem_only: true,
        }))
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
        let templates = self
            .0
            .templates
            .lock()
            .unwrap()
            .iter()
            .map(|(n, b)| {
                template(
                    n,
                    b,
                    if b == "snapb" {
                        "snapshot"
                    } else {
                        "directory"
                    },
                )
            })
            .collect();
        Ok(Response::new(pb::ListTemplatesResponse { templates }))
    }
    async fn import_template(&self, _r: Request<pb::ImportTemplateRequest>) -> R<pb::Template> {
        Err(Status::unimplemented("fake"))
    }
    async fn delete_template(
        &self,
        r: Request<pb::DeleteTemplateRequest>,
    ) -> R<pb::DeleteTemplateResponse> {
        let r = r.into_inner();
        if self.0.sandboxes_of(&r.name) > 0 {
            return Err(Status::failed_precondition("template in use"));
        }
        match self.0.templates.lock().unwrap().remove(&r.name) {
            Some(_) => Ok(Response::new(pb::DeleteTemplateResponse {
                builds_deleted: 1,
            })),
            None => Err(Status::not_found("no such template")),
        }
    }
    type BuildTemplateStream = std::pin::Pin<
        Box<dyn futures_core::Stream<Item = Result<pb::TemplateBuildEvent, Status>> + Send>,
    >;
    async fn build_template(
        &self,
        r: Request<pb::ImportTemplateRequest>,
    ) -> R<Self::BuildTemplateStream> {
        let r = r.into_inner();
        if self.0.fail_build {
            return Err(Status::internal("mkfs.ext4 missing"));
        }
        self.0
            .templates
            .lock()
            .unwrap()
            .insert(r.name.clone(), "nb1".into());
        let ev = |kind: &str, msg: &str, t: Option<pb::Template>| {
            Ok(pb::TemplateBuildEvent {
                kind: kind.into(),
                message: msg.into(),
                done: 0,
                total: 0,
                template: t,
            })
        };
        let events = vec![
            ev("phase", "hashing inputs", None),
            ev("progress", "copying", None),
            ev("done", "ready", Some(template(&r.name, "nb1", "directory"))),
        ];
        Ok(Response::new(Box::pin(futures_util::stream::iter(events))))
    }
    async fn sandbox_stats(&self, r: Request<pb::SandboxRef>) -> R<pb::SandboxStatsResponse> {
        if !self
            .0
            .sandboxes
            .lock()
            .unwrap()
            .contains_key(&r.into_inner().sandbox_id)
        {
            return Err(Status::not_found("no such sandbox"));
        }
        Ok(Response::new(pb::SandboxStatsResponse {
            cpu_count: 2,
            cpu_used_pct: 50.0,
            mem_used_bytes: 1 << 20,
            mem_total_bytes: 512 << 20,
            timestamp_ms: 42,
            ..Default::default()
        }))
    }
    async fn node_status(&self, _r: Request<pb::NodeStatusRequest>) -> R<pb::NodeStatusResponse> {
        // Only `base` is advertised: a fresh snapshot is not in the polled list yet, and the
        // master must not need it there.
        Ok(Response::new(pb::NodeStatusResponse {
            node_id: self.0.id.clone(),
            runtime: "namespace".into(),
            templates: if self
                .0
                .advertise_all
                .load(std::sync::atomic::Ordering::SeqCst)
            {
                self.0.templates.lock().unwrap().keys().cloned().collect()
            } else {
                vec!["base".into()]
            },
            sandboxes: self.0.sandboxes.lock().unwrap().len() as u32,
            capacity: Some(pb::Capacity {
                max_sandboxes: self.0.max,
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
    let incoming = futures_util::stream::unfold(l, |l| async move {
        let r = l.accept().await.map(|(s, _)| s);
        Some((r, l))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeServer::new(Handle(n)))
            .serve_with_incoming(incoming),
    );
    format!("http://{addr}")
}

async fn controller(nodes: &[String]) -> (Controller, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(&format!("sqlite://{}/m.db?mode=rwc", dir.path().display()))
        .await
        .unwrap();
    let ns = Nodes::new(nodes, 2).unwrap();
    ns.poll_once().await;
    let cfg = MasterConfig {
        nodes: nodes.to_vec(),
        ..Default::default()
    };
    (Controller::new(cfg, db, ns), dir)
}

fn params(team: &str, template: &str) -> CreateParams {
    CreateParams {
        team_id: team.into(),
        template: template.into(),
        timeout_s: 60,
        ..Default::default()
    }
}

/// The source sandbox lands on `b` (emptier); then `b` is loaded so that the scheduler alone
/// would pick `a`: creates from the snapshot must still all go to `b`, which holds it.
#[tokio::test]
async fn create_from_snapshot_is_pinned_to_its_node() {
    let a = FakeNode::new("a", 100);
    let b = FakeNode::new("b", 100);
    let (addr_a, addr_b) = (serve(a.clone()).await, serve(b.clone()).await);
    let (ctl, _d) = controller(&[addr_a.clone(), addr_b.clone()]).await;
    // Give `a` more load so that ordinary creates prefer `b`.
    for _ in 0..3 {
        a.sandboxes
            .lock()
            .unwrap()
            .insert(format!("x{}", rand_suffix()), "base".into());
    }
    ctl.nodes.poll_once().await;
    let src = ctl.create(params("t", "base")).await.unwrap();
    assert_eq!(src.node_id, "b", "ordinary creates go to the emptier node");
    // Snapshot it on `b`, then load `b` so that the scheduler would now pick `a`.
    let s = ctl.snapshot("t", &src.id, "my-snap").await.unwrap();
    assert!(s.id.starts_with('s') && s.id.len() == 20, "{}", s.id);
    assert_eq!(s.node_id, "b");
    assert_eq!(s.sandbox_id, src.id);
    assert_eq!(
        grpc::snapshot_info(&s).names,
        vec![s.id.clone(), "my-snap".to_string()]
    );
    assert!(grpc::snapshot_info(&s).filesystem_only);
    assert!(b.holds(&s.id) && !a.holds(&s.id));
    for _ in 0..6 {
        b.sandboxes
            .lock()
            .unwrap()
            .insert(format!("y{}", rand_suffix()), "base".into());
    }
    ctl.nodes.poll_once().await;
    assert_eq!(ctl.create(params("t", "base")).await.unwrap().node_id, "a");
    // By id and by name, every create from the snapshot lands on `b`, which holds it.
    for key in [s.id.as_str(), s.id.as_str(), "my-snap"] {
        let r = ctl.create(params("t", key)).await.unwrap();
        assert_eq!(r.node_id, "b", "create from {key}");
        assert_eq!(r.template, s.id, "a name resolves to the snapshot id");
    }
    assert_eq!(b.sandboxes_of(&s.id), 3);
    // Another team cannot see or use it (neither by id nor by name), even once the node
    // advertises the snapshot as one of its templates.
    b.advertise_all
        .store(true, std::sync::atomic::Ordering::SeqCst);
    ctl.nodes.poll_once().await;
    assert!(matches!(
        ctl.create(params("u", &s.id)).await,
        Err(MasterError::NotFound(_))
    ));
    assert_eq!(b.sandboxes_of(&s.id), 3, "team u's create reached the node");
    assert!(matches!(
        ctl.create(params("u", "my-snap")).await,
        Err(MasterError::NotFound(_))
    ));
    // A full holder means no capacity, not a create on a node without the snapshot.
    let (c2, _d2) = {
        let full = FakeNode::new("full", 1);
        full.sandboxes
            .lock()
            .unwrap()
            .insert("z".into(), "base".into());
        let addr = serve(full.clone()).await;
        let (c, d) = controller(&[addr, addr_a.clone()]).await;
        c.db.insert_snapshot(&cube_master::store::snapshots::SnapshotRow {
            id: "sfull".into(),
            name: String::new(),
            team_id: "t".into(),
            sandbox_id: "z".into(),
            node_id: "full".into(),
            template: "base".into(),
            build: "snapb".into(),
            filesystem_only: 1,
            created_at_ms: 1,
        })
        .await
        .unwrap();
        (c, d)
    };
    assert!(matches!(
        c2.create(params("t", "sfull")).await,
        Err(MasterError::ResourceExhausted(_))
    ));
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

#[tokio::test]
async fn list_paging_filters_and_delete_in_use() {
    let a = FakeNode::new("a", 100);
    let (ctl, _d) = controller(&[serve(a.clone()).await]).await;
    let s1 = ctl.create(params("t", "base")).await.unwrap();
    let s2 = ctl.create(params("t", "base")).await.unwrap();
    let other = ctl.create(params("u", "base")).await.unwrap();
    let mut ids = Vec::new();
    for (sb, name) in [(&s1, "one"), (&s1, ""), (&s2, "two")] {
        ids.push(ctl.snapshot("t", &sb.id, name).await.unwrap().id);
        tokio::time::sleep(std::time::Duration::from_millis(3)).await;
    }
    let theirs = ctl.snapshot("u", &other.id, "").await.unwrap();
    // Bad names and other teams' sandboxes are refused before the node is asked.
    assert!(matches!(
        ctl.snapshot("t", &s1.id, "Bad Name").await,
        Err(MasterError::InvalidArgument(_))
    ));
    assert!(matches!(
        ctl.snapshot("t", &other.id, "").await,
        Err(MasterError::NotFound(_))
    ));
    // Paging: newest first, one per page, the team's own only.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let (rows, next) = ctl
            .list_snapshots(&mpb::ListSnapshotsRequest {
                team_id: "t".into(),
                limit: 1,
                next_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(rows.len() <= 1);
        seen.extend(rows.into_iter().map(|r| r.id));
        if next.is_empty() {
            break;
        }
        token = next;
    }
    let mut want = ids.clone();
    want.reverse();
    assert_eq!(seen, want);
    assert!(!seen.contains(&theirs.id));
    let sr = &ctl;
    let by_sb = |sid: &str, name: &str| {
        let r = mpb::ListSnapshotsRequest {
            team_id: "t".into(),
            sandbox_id: sid.into(),
            name: name.into(),
            ..Default::default()
        };
        async move {
            sr.list_snapshots(&r)
                .await
                .unwrap()
                .0
                .into_iter()
                .map(|r| r.id)
                .collect::<BTreeSet<_>>()
        }
    };
    assert_eq!(by_sb(&s1.id, "").await, ids[..2].iter().cloned().collect());
    assert_eq!(
        by_sb("", "two").await,
        [ids[2].clone()].into_iter().collect()
    );
    assert!(ctl
        .list_snapshots(&mpb::ListSnapshotsRequest {
            team_id: "t".into(),
            next_token: "garbage".into(),
            ..Default::default()
        })
        .await
        .is_err());

    // Deleting a snapshot that live sandboxes came from is refused, and leaves it usable.
    let child = ctl.create(params("t", "one")).await.unwrap();
    let e = ctl.delete_snapshot("t", &ids[0]).await.unwrap_err();
    assert!(matches!(e, MasterError::FailedPrecondition(_)), "{e}");
    assert!(a.holds(&ids[0]));
    // Another team's delete does not find it.
    assert!(!ctl.delete_snapshot("u", &ids[0]).await.unwrap());
    assert!(ctl.kill("t", &child.id, "test").await.unwrap());
    // By name this time; the build goes from the node and the row from the list.
    assert!(ctl.delete_snapshot("t", "one").await.unwrap());
    assert!(!a.holds(&ids[0]));
    assert!(!ctl.delete_snapshot("t", &ids[0]).await.unwrap());
    assert!(matches!(
        ctl.create(params("t", &ids[0])).await,
        Err(MasterError::NotFound(_))
    ));
    // The source sandbox being gone does not matter to its snapshots.
    assert!(ctl.kill("t", &s2.id, "test").await.unwrap());
    let r = ctl.create(params("t", &ids[2])).await.unwrap();
    assert_eq!(r.template, ids[2]);
}

#[tokio::test]
async fn fork_snapshots_once_and_creates_count() {
    let a = FakeNode::new("a", 100);
    let (ctl, _d) = controller(&[serve(a.clone()).await]).await;
    let mut p = params("t", "base");
    p.metadata.insert("k".into(), "v".into());
    let src = ctl.create(p).await.unwrap();
    // Out-of-range asks leave nothing behind.
    assert!(matches!(
        ctl.fork("t", &src.id, 21, 0).await,
        Err(MasterError::InvalidArgument(_))
    ));
    assert!(matches!(
        ctl.fork("t", &src.id, 2, 10 * 24 * 3600).await,
        Err(MasterError::InvalidArgument(_))
    ));
    assert!(matches!(
        ctl.fork("t", "inope", 2, 0).await,
        Err(MasterError::NotFound(_))
    ));
    assert_eq!(
        a.templates.lock().unwrap().len(),
        1,
        "no snapshot was taken"
    );
    let (snap, results) = ctl.fork("t", &src.id, 2, 120).await.unwrap();
    assert_eq!(results.len(), 2);
    let kids: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    assert_ne!(kids[0].id, kids[1].id);
    for k in &kids {
        assert_eq!(k.template, snap.id);
        assert_eq!(k.metadata_map().get("k").map(String::as_str), Some("v"));
        let life = k.end_at_ms - k.started_at_ms;
        assert!((119_000..=121_000).contains(&life), "{life}");
    }
    assert_eq!(a.sandboxes_of(&snap.id), 2);
    // The source keeps running.
    assert_eq!(
        ctl.get("t", &src.id).await.unwrap().state,
        SandboxState::Running
    );

    // Metrics come from the sandbox's node; unknown ids are 404s.
    let m = ctl.sandbox_stats("t", &kids[0].id).await.unwrap();
    assert_eq!((m.cpu_count, m.cpu_used_pct), (2, 50.0));
    assert!(matches!(
        ctl.sandbox_stats("u", &kids[0].id).await,
        Err(MasterError::NotFound(_))
    ));
}

#[tokio::test]
async fn catalog_lists_builds_and_deletes_across_nodes() {
    let a = FakeNode::new("a", 100);
    let b = FakeNode::new("b", 100);
    let bad = Arc::new(FakeNode {
        id: "bad".into(),
        max: 100,
        fail_build: true,
        ..Default::default()
    });
    let addrs = vec![
        serve(a.clone()).await,
        serve(b.clone()).await,
        serve(bad.clone()).await,
    ];
    let (ctl, _d) = controller(&addrs).await;
    let src = ctl.create(params("t", "base")).await.unwrap();
    let snap = ctl.snapshot("t", &src.id, "").await.unwrap();

    let list = ctl.list_templates().await.unwrap();
    let base = list.iter().find(|t| t.name == "base").unwrap();
    assert_eq!(
        base.node_ids.iter().cloned().collect::<BTreeSet<_>>(),
        ["a", "b"].iter().map(|s| s.to_string()).collect()
    );
    assert!(base.snapshot_id.is_empty());
    let st = list.iter().find(|t| t.name == snap.id).unwrap();
    assert_eq!(st.snapshot_id, snap.id);
    assert_eq!(st.node_ids, vec![snap.node_id.clone()]);
    assert_eq!(ctl.get_template("base").await.unwrap().len(), 1);
    assert!(matches!(
        ctl.get_template("nope").await,
        Err(MasterError::NotFound(_))
    ));

    // A build on every ready node: each node's events tagged with it, each ending in one
    // verdict, the failing node's as an error event without stopping the others.
    let recipe = pb::ImportTemplateRequest {
        name: "fresh".into(),
        source: Some(pb::import_template_request::Source::Directory(
            "/srv/root".into(),
        )),
        extra_mib: 0,
    };
    let events: Vec<mpb::BuildTemplateEvent> = ctl
        .build_template(mpb::BuildTemplateRequest {
            recipe: Some(recipe.clone()),
            node_id: String::new(),
        })
        .await
        .unwrap()
        .map(|e| e.unwrap())
        .collect()
        .await;
    let mut verdicts: BTreeMap<String, String> = BTreeMap::new();
    for e in &events {
        if e.kind == "done" || e.kind == "error" {
            assert!(
                verdicts.insert(e.node_id.clone(), e.kind.clone()).is_none(),
                "one verdict per node"
            );
        }
        if e.kind == "done" {
            let t = e.template.as_ref().unwrap();
            assert_eq!(
                (t.name.as_str(), t.node_ids.clone()),
                ("fresh", vec![e.node_id.clone()])
            );
        }
    }
    assert_eq!(verdicts.get("a").map(String::as_str), Some("done"));
    assert_eq!(verdicts.get("b").map(String::as_str), Some("done"));
    assert_eq!(verdicts.get("bad").map(String::as_str), Some("error"));
    assert!(events
        .iter()
        .any(|e| e.node_id == "bad" && e.message.contains("mkfs.ext4 missing")));
    assert!(events.iter().any(|e| e.node_id == "a" && e.kind == "phase"));
    // One node only.
    let one: Vec<_> = ctl
        .build_template(mpb::BuildTemplateRequest {
            recipe: Some(pb::ImportTemplateRequest {
                name: "solo".into(),
                ..recipe.clone()
            }),
            node_id: "b".into(),
        })
        .await
        .unwrap()
        .collect()
        .await;
    assert!(one.iter().all(|e| e.as_ref().unwrap().node_id == "b"));
    assert!(b.holds("solo") && !a.holds("solo"));
    // Bad requests fail before any node is asked.
    for req in [
        mpb::BuildTemplateRequest::default(),
        mpb::BuildTemplateRequest {
            recipe: Some(pb::ImportTemplateRequest {
                name: "x".into(),
                source: None,
                extra_mib: 0,
            }),
            node_id: String::new(),
        },
    ] {
        assert!(matches!(
            ctl.build_template(req).await,
            Err(MasterError::InvalidArgument(_))
        ));
    }
    assert!(matches!(
        ctl.build_template(mpb::BuildTemplateRequest {
            recipe: Some(recipe),
            node_id: "ghost".into(),
        })
        .await,
        Err(MasterError::NotFound(_))
    ));

    // Deleting a template goes to the nodes the poll says hold it; a snapshot id goes
    // through the snapshot path (its row too).
    assert!(ctl.delete_template("nope").await.is_err());
    assert!(ctl.kill("t", &src.id, "test").await.unwrap());
    assert_eq!(ctl.delete_template("base").await.unwrap(), 2);
    assert!(!a.holds("base") && !b.holds("base"));
    assert_eq!(ctl.delete_template(&snap.id).await.unwrap(), 1);
    assert!(ctl.db.get_snapshot(&snap.id).await.unwrap().is_none());
}
