//! Node lifecycle on both backends: registration with and without join tokens, heartbeats and
//! their timeout (sandboxes reported lost, then reconciled), cordon, drain. Nodes are in-process
//! fake cubelets over real gRPC (tests/common); the real cubelet is in cubelet/tests/master.rs.

#[macro_use]
mod common;

use common::{controller, params, serve, FakeNode};
use cube_master::ops::{Controller, CreateParams, ListParams};
use cube_master::state::SandboxState;
use cube_master::{grpc, MasterConfig, MasterError};
use cube_proto::master::v1 as pb;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn reg(id: &str, address: &str, token: &str, secret: &str) -> pb::RegisterNodeRequest {
    pb::RegisterNodeRequest {
        node_id: id.into(),
        address: address.into(),
        join_token: token.into(),
        version: "0.1.0".into(),
        runtime: "namespace".into(),
        kvm_kind: "pvm".into(),
        vcpus: 4,
        memory_mib: 8192,
        max_sandboxes: 0,
        node_secret: secret.into(),
    }
}

fn beat(id: &str, secret: &str) -> pb::NodeHeartbeatRequest {
    pb::NodeHeartbeatRequest {
        node_id: id.into(),
        node_secret: secret.into(),
        sandboxes: 0,
        templates: vec!["base".into()],
        disk_free_mib: 1000,
        memory_mib: 4096,
    }
}

async fn registration_and_tokens(url: String) {
    let cfg = MasterConfig {
        require_join_token: true,
        ..Default::default()
    };
    let ctl = controller(&url, &[], cfg).await;
    let addr = "http://127.0.0.1:1";
    // No token: refused.
    let e = ctl
        .register_node(reg("n1", addr, "", ""))
        .await
        .unwrap_err();
    assert!(matches!(e, MasterError::Unauthenticated(_)), "{e}");
    // A made-up token: refused.
    let e = ctl
        .register_node(reg("n1", addr, "cjt_00", ""))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("unknown token"), "{e}");
    let (token, exp) = ctl.create_join_token(0).await.unwrap();
    assert!(exp > cube_master::now_ms() + 3_500_000);
    let r = ctl
        .register_node(reg("n1", addr, &token, ""))
        .await
        .unwrap();
    assert_eq!(r.node_id, "n1");
    assert!(r.node_secret.len() >= 32);
    assert_eq!(r.heartbeat_interval_ms, 2000);
    // The token is single use, also for another node.
    let e = ctl
        .register_node(reg("n2", addr, &token, ""))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("already used"), "{e}");
    // Stored hashed: neither the token nor the secret is in the database.
    let row = ctl.db.get_node("n1").await.unwrap().unwrap();
    assert_ne!(row.secret_sha256, r.node_secret);
    assert_eq!(row.secret_sha256.len(), 64);
    // A known node re-registers with its secret (restart, new address) and keeps it.
    let r2 = ctl
        .register_node(reg("n1", "http://127.0.0.1:2", "", &r.node_secret))
        .await
        .unwrap();
    assert_eq!(r2.node_secret, r.node_secret);
    assert_eq!(ctl.nodes.find("n1").unwrap().address, "http://127.0.0.1:2");
    // ... but a wrong secret does not let anyone take the id over.
    let e = ctl
        .register_node(reg("n1", addr, "", "not-the-secret"))
        .await
        .unwrap_err();
    assert!(matches!(e, MasterError::Unauthenticated(_)), "{e}");
    // Heartbeats: right secret accepted, wrong refused, unknown node told to register.
    let h = ctl
        .node_heartbeat(beat("n1", &r.node_secret))
        .await
        .unwrap();
    assert!(!h.reregister && !h.cordoned);
    assert!(matches!(
        ctl.node_heartbeat(beat("n1", "wrong")).await,
        Err(MasterError::Unauthenticated(_))
    ));
    assert!(
        ctl.node_heartbeat(beat("ghost", "x"))
            .await
            .unwrap()
            .reregister
    );
    // Bad input is refused clearly.
    for (id, a) in [
        ("", addr),
        ("a b", addr),
        ("ok", "not a url"),
        ("ok", "ftp://x"),
    ] {
        let e = ctl.register_node(reg(id, a, &token, "")).await.unwrap_err();
        assert!(
            matches!(e, MasterError::InvalidArgument(_)),
            "{id:?} {a:?}: {e}"
        );
    }
    assert!(matches!(
        ctl.create_join_token(365 * 24 * 3600).await,
        Err(MasterError::InvalidArgument(_))
    ));
    let infos = grpc::node_infos(&ctl);
    assert_eq!(infos.len(), 1);
    let i = &infos[0];
    assert_eq!(
        (i.node_id.as_str(), i.status.as_str(), i.origin.as_str()),
        ("n1", "ready", "registered")
    );
    assert_eq!((i.vcpus, i.memory_mib, i.disk_free_mib), (4, 8192, 1000));
    assert_eq!(i.templates, ["base"]);
    assert!(i.last_seen_ms > 0);

    // A restarted master knows the node (Unknown until it heartbeats) and its secret.
    let cfg = MasterConfig {
        require_join_token: true,
        ..Default::default()
    };
    let ctl2 = controller(&url, &[], cfg).await;
    assert_eq!(grpc::node_infos(&ctl2)[0].status, "not_ready");
    let h = ctl2
        .node_heartbeat(beat("n1", &r.node_secret))
        .await
        .unwrap();
    assert!(!h.reregister);
    assert_eq!(grpc::node_infos(&ctl2)[0].status, "ready");
}
both_backends!(registration, super::registration_and_tokens);

async fn open_registration(url: String) {
    let ctl = controller(&url, &[], MasterConfig::default()).await;
    let r = ctl
        .register_node(reg("n1", "http://127.0.0.1:1", "", ""))
        .await
        .unwrap();
    assert!(!r.node_secret.is_empty());
    // A stale token does not matter when tokens are not required.
    ctl.register_node(reg("n2", "http://127.0.0.1:1", "cjt_stale", ""))
        .await
        .unwrap();
    assert_eq!(grpc::node_infos(&ctl).len(), 2);
}
both_backends!(registration_without_token, super::open_registration);

/// A registered fake node that heartbeats on demand.
async fn registered(ctl: &Controller, node: &std::sync::Arc<FakeNode>, addr: &str) -> String {
    let r = ctl
        .register_node(reg(&node.id, addr, "", ""))
        .await
        .unwrap();
    ctl.node_heartbeat(beat(&node.id, &r.node_secret))
        .await
        .unwrap();
    r.node_secret
}

/// Polls `f` until it holds (a wait on the state itself, not a guess at how long it takes).
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !f().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Checks the nodes until the only one is not ready (its heartbeats stopped).
async fn until_not_ready(ctl: &Controller) {
    until("the silent node to be not ready", || async {
        ctl.check_nodes().await;
        grpc::node_infos(ctl)[0].status == "not_ready"
    })
    .await;
}

async fn heartbeat_timeout(url: String) {
    let cfg = MasterConfig {
        heartbeat_interval_ms: 100,
        node_max_misses: 2,
        ..Default::default()
    };
    let ctl = controller(&url, &[], cfg).await;
    let node = FakeNode::new("hb");
    let (addr, _stop) = serve(node.clone()).await;
    let secret = registered(&ctl, &node, &addr).await;
    let a = ctl.create(params()).await.unwrap();
    let b = ctl.create(params()).await.unwrap();
    ctl.pause("t", &b.id, false).await.unwrap();
    assert_eq!((a.node_id.as_str(), node.count()), ("hb", 2));
    // Silence for longer than 2 intervals: not ready, and its sandboxes are reported lost.
    until_not_ready(&ctl).await;
    for id in [&a.id, &b.id] {
        let r = ctl.get("t", id).await.unwrap();
        assert_eq!(r.state, SandboxState::Lost, "{id}");
        assert!(r.reason.contains("not ready"), "{}", r.reason);
    }
    let (lost, _) = ctl
        .list(ListParams {
            states: vec![SandboxState::Lost],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(lost.len(), 2);
    // Nothing new goes there, and a lost sandbox cannot be paused or connected.
    assert!(matches!(
        ctl.create(params()).await,
        Err(MasterError::Unavailable(_))
    ));
    assert!(matches!(
        ctl.pause("t", &a.id, false).await,
        Err(MasterError::FailedPrecondition(_))
    ));
    // Killing one while the node is away is recorded at once; the node drops it on return.
    assert!(ctl.kill("t", &b.id, "user").await.unwrap());
    assert_eq!(node.count(), 2);
    // The node is back: the other is running again, the killed one is removed there.
    ctl.node_heartbeat(beat("hb", &secret)).await.unwrap();
    ctl.check_nodes().await;
    assert_eq!(grpc::node_infos(&ctl)[0].status, "ready");
    let r = ctl.get("t", &a.id).await.unwrap();
    assert_eq!(
        (r.state.as_str(), r.reason.as_str()),
        ("running", "node hb is back")
    );
    assert_eq!(node.count(), 1);
    assert!(node.state_of(&a.id).is_some());
    assert!(ctl.db.get_sandbox(&b.id).await.unwrap().unwrap().state == SandboxState::Killed);
    assert_eq!(ctl.metrics.lost.get(), 2);
    // A node that comes back without its sandbox: failed, with the reason.
    until_not_ready(&ctl).await;
    node.sandboxes.lock().unwrap().clear();
    ctl.node_heartbeat(beat("hb", &secret)).await.unwrap();
    ctl.check_nodes().await;
    let r = ctl.db.get_sandbox(&a.id).await.unwrap().unwrap();
    assert_eq!(r.state, SandboxState::Failed);
    assert!(r.reason.contains("no longer has"), "{}", r.reason);
}
both_backends!(heartbeat_timeout_marks_lost, super::heartbeat_timeout);

/// A Ready node is reconciled every `reconcile_interval_ms`: a row whose sandbox the node no
/// longer runs is ended with the reason, and a sandbox no row claims is killed once it is
/// older than `orphan_grace_ms` (younger ones may be creates in flight).
async fn periodic_reconcile(url: String) {
    let cfg = MasterConfig {
        reconcile_interval_ms: 50,
        orphan_grace_ms: 60_000,
        ..Default::default()
    };
    let ctl = controller(&url, &[], cfg).await;
    let node = FakeNode::new("rc");
    let (addr, _stop) = serve(node.clone()).await;
    registered(&ctl, &node, &addr).await;
    let a = ctl.create(params()).await.unwrap();
    let b = ctl.create(params()).await.unwrap();
    let c = ctl.create(params()).await.unwrap();
    ctl.pause("t", &b.id, false).await.unwrap();
    ctl.check_nodes().await;
    assert_eq!(
        node.count(),
        3,
        "a reconcile of a node in step changes nothing"
    );
    // The node knows each running sandbox's end (its backstop), and follows a new timeout.
    let end_on_node = |id: &str| node.ends.lock().unwrap().get(id).copied().unwrap_or(0) as i64;
    for r in [&a, &c] {
        let row = ctl.db.get_sandbox(&r.id).await.unwrap().unwrap();
        assert_eq!(end_on_node(&r.id), row.end_at_ms);
    }
    let row = ctl.set_timeout("t", &c.id, 900, false).await.unwrap();
    assert_eq!(end_on_node(&c.id), row.end_at_ms);
    // One paused at its end is the master's alone to end: the node gets no end for it.
    let ap = ctl
        .create(CreateParams {
            auto_pause: true,
            ..params()
        })
        .await
        .unwrap();
    assert_eq!(end_on_node(&ap.id), 0);
    assert!(ctl.kill("t", &ap.id, "user").await.unwrap());
    // An end the node missed (a SetEndTime that failed) is sent again by the next reconcile.
    node.ends.lock().unwrap().insert(c.id.clone(), 1);
    tokio::time::sleep(Duration::from_millis(60)).await;
    ctl.check_nodes().await;
    assert_eq!(end_on_node(&c.id), row.end_at_ms);
    // The node lost `a` (say its process died and a restart could not re-adopt it), and runs
    // two sandboxes no row claims: one just started (a create in flight), one long ago.
    node.sandboxes.lock().unwrap().remove(&a.id);
    let now = cube_master::now_ms() as u64;
    for (id, created) in [("young1", now), ("old1", now - 600_000)] {
        let st = cube_proto::nodev1::SandboxState::Running as i32;
        node.sandboxes.lock().unwrap().insert(id.into(), st);
        node.created_ms.lock().unwrap().insert(id.into(), created);
    }
    // Nothing happens before the interval has passed.
    ctl.check_nodes().await;
    assert_eq!(
        ctl.get("t", &a.id).await.unwrap().state,
        SandboxState::Running
    );
    tokio::time::sleep(Duration::from_millis(60)).await;
    ctl.check_nodes().await;
    let r = ctl.db.get_sandbox(&a.id).await.unwrap().unwrap();
    assert_eq!(r.state, SandboxState::Killed);
    assert!(
        r.reason.contains("gone: node rc no longer runs"),
        "{}",
        r.reason
    );
    assert!(
        node.state_of("old1").is_none(),
        "the old orphan was not killed"
    );
    assert!(
        node.state_of("young1").is_some(),
        "a young sandbox was taken for an orphan"
    );
    assert_eq!(
        ctl.get("t", &b.id).await.unwrap().state,
        SandboxState::Paused
    );
    assert_eq!(
        ctl.get("t", &c.id).await.unwrap().state,
        SandboxState::Running
    );
    assert_eq!(
        (ctl.metrics.gone.get(), ctl.metrics.orphans_killed.get()),
        (1, 1)
    );
    // Once it is older than the grace period it goes too; a killed row's sandbox at once.
    node.created_ms
        .lock()
        .unwrap()
        .insert("young1".into(), now - 600_000);
    assert!(ctl.kill("t", &c.id, "user").await.unwrap());
    node.sandboxes.lock().unwrap().insert(
        c.id.clone(),
        cube_proto::nodev1::SandboxState::Running as i32,
    );
    tokio::time::sleep(Duration::from_millis(60)).await;
    ctl.check_nodes().await;
    assert!(node.state_of("young1").is_none() && node.state_of(&c.id).is_none());
    assert_eq!(node.count(), 1);
    assert_eq!(ctl.metrics.orphans_killed.get(), 3);
    assert_eq!(
        ctl.get("t", &b.id).await.unwrap().state,
        SandboxState::Paused
    );
}
both_backends!(
    periodic_reconcile_ends_gone_rows_and_kills_orphans,
    super::periodic_reconcile
);

/// A create's timeout counts from when the sandbox is ready: the node sets that end itself
/// (`timeout_ms`) and the master records the node's end, with no SetEndTime after; a node
/// that keeps the create's backstop end (one from before `timeout_ms`) is told the end.
async fn create_end_counts_from_ready(url: String) {
    for ignores_timeout in [false, true] {
        let node = std::sync::Arc::new(FakeNode {
            id: format!("end{}", u8::from(ignores_timeout)),
            templates: vec!["base".into()],
            ignores_timeout,
            create_delay_ms: 200,
            ..Default::default()
        });
        let (addr, _stop) = serve(node.clone()).await;
        let ctl = controller(&url, std::slice::from_ref(&addr), MasterConfig::default()).await;
        ctl.nodes.poll_once().await;
        let before = cube_master::now_ms();
        let a = ctl.create(params()).await.unwrap();
        let after = cube_master::now_ms();
        let row = ctl.db.get_sandbox(&a.id).await.unwrap().unwrap();
        let on_node = node.ends.lock().unwrap().get(&a.id).copied().unwrap_or(0) as i64;
        assert_eq!(on_node, row.end_at_ms, "ignores_timeout={ignores_timeout}");
        assert_eq!(row.end_at_ms - row.started_at_ms, 600_000);
        // Counted from when it was ready (after the node's 200 ms), not from the request.
        assert!(
            row.started_at_ms >= before + 200 && row.started_at_ms <= after,
            "started {} not in [{}, {after}]",
            row.started_at_ms,
            before + 200
        );
        assert_eq!(a.end_at_ms, row.end_at_ms);
    }
}
both_backends!(create_end, super::create_end_counts_from_ready);

async fn static_node_down_marks_lost(url: String) {
    let node = FakeNode::new("st");
    let (addr, stop) = serve(node.clone()).await;
    let cfg = MasterConfig {
        node_max_misses: 2,
        ..Default::default()
    };
    let ctl = controller(&url, std::slice::from_ref(&addr), cfg).await;
    let a = ctl.create(params()).await.unwrap();
    let _ = stop.send(());
    // The node is down once its port refuses connections (the next poll must fail).
    let port = addr.trim_start_matches("http://").to_string();
    until("the stopped node's port to refuse", || {
        let port = port.clone();
        async move { tokio::net::TcpStream::connect(port).await.is_err() }
    })
    .await;
    ctl.nodes.poll_once().await;
    ctl.check_nodes().await;
    assert_eq!(
        ctl.get("t", &a.id).await.unwrap().state,
        SandboxState::Running
    );
    ctl.nodes.poll_once().await;
    ctl.check_nodes().await;
    let r = ctl.get("t", &a.id).await.unwrap();
    assert_eq!(r.state, SandboxState::Lost);
    assert!(r.reason.contains("polls failed"), "{}", r.reason);
    assert_eq!(grpc::node_infos(&ctl)[0].origin, "static");
}
both_backends!(static_node_down, super::static_node_down_marks_lost);

async fn cordon_skips_node(url: String) {
    // `big` would win on free capacity.
    let big = std::sync::Arc::new(FakeNode {
        id: "big".into(),
        max: 100,
        templates: vec!["base".into()],
        ..Default::default()
    });
    let small = std::sync::Arc::new(FakeNode {
        id: "small".into(),
        max: 10,
        templates: vec!["base".into()],
        ..Default::default()
    });
    let (a1, _s1) = serve(big.clone()).await;
    let (a2, _s2) = serve(small.clone()).await;
    let statics = vec![a1.clone(), a2.clone()];
    let ctl = controller(&url, &statics, MasterConfig::default()).await;
    assert_eq!(ctl.create(params()).await.unwrap().node_id, "big");
    let info = ctl.set_cordon("big", true).await.unwrap();
    assert!(info.cordoned);
    for _ in 0..3 {
        assert_eq!(ctl.create(params()).await.unwrap().node_id, "small");
    }
    // By address works too; everything cordoned = nowhere to go.
    ctl.set_cordon(&a2, true).await.unwrap();
    assert!(matches!(
        ctl.create(params()).await,
        Err(MasterError::Unavailable(_))
    ));
    assert!(matches!(
        ctl.set_cordon("nope", true).await,
        Err(MasterError::NotFound(_))
    ));
    ctl.set_cordon("small", false).await.unwrap();
    // The cordon survives a master restart.
    let ctl2 = controller(&url, &statics, MasterConfig::default()).await;
    let infos = grpc::node_infos(&ctl2);
    let by_id = |id: &str| infos.iter().find(|i| i.node_id == id).unwrap().cordoned;
    assert!(by_id("big"));
    assert!(!by_id("small"));
    assert_eq!(ctl2.create(params()).await.unwrap().node_id, "small");
    assert_eq!(big.creates.load(Ordering::SeqCst), 1);
}
both_backends!(cordon, super::cordon_skips_node);

async fn back_to_back_creates_spread(url: String) {
    // Two equal nodes and creates faster than the status poll: each finished create must count
    // on its node until a poll reports it, or every create would see the same tie.
    let mk = |id: &str| {
        std::sync::Arc::new(FakeNode {
            id: id.into(),
            max: 10,
            templates: vec!["base".into()],
            ..Default::default()
        })
    };
    let (a, b) = (mk("a"), mk("b"));
    let (a1, _s1) = serve(a.clone()).await;
    let (a2, _s2) = serve(b.clone()).await;
    let ctl = controller(&url, &[a1, a2], MasterConfig::default()).await;
    for _ in 0..4 {
        ctl.create(params()).await.unwrap();
    }
    assert_eq!(a.creates.load(Ordering::SeqCst), 2);
    assert_eq!(b.creates.load(Ordering::SeqCst), 2);
    // Once a poll has counted them, the pending entries are gone (the fake's count is what
    // the node says; no double counting). Creates that finish in the poll's own millisecond
    // are kept on purpose: the poll is sent a few milliseconds after the last one.
    tokio::time::sleep(Duration::from_millis(5)).await;
    ctl.nodes.poll_once().await;
    let pending: usize = ctl.nodes.snapshot().iter().map(|n| n.placed_ms.len()).sum();
    assert_eq!(pending, 0);
}
both_backends!(back_to_back_spread, super::back_to_back_creates_spread);

async fn drain(url: String) {
    let node = FakeNode::new("dr");
    let other = FakeNode::new("other");
    let (addr, _s) = serve(node.clone()).await;
    let (addr2, _s2) = serve(other.clone()).await;
    let ctl = controller(&url, &[addr], MasterConfig::default()).await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(ctl.create(params()).await.unwrap().id);
    }
    ctl.pause("t", &ids[0], false).await.unwrap();
    let r = ctl.drain_node("dr", false).await.unwrap();
    assert!(r.node.cordoned);
    assert_eq!(r.sandboxes.len(), 4);
    assert!(
        r.sandboxes.iter().all(|d| d.outcome == "paused"),
        "{:?}",
        r.sandboxes
    );
    for id in &ids {
        assert_eq!(ctl.get("t", id).await.unwrap().state, SandboxState::Paused);
    }
    // One pause each for the three running ones plus the earlier one.
    assert_eq!(node.pauses.load(Ordering::SeqCst), 4);
    // Draining with kill: every sandbox killed and reported.
    let r = ctl.drain_node("dr", true).await.unwrap();
    assert_eq!(r.sandboxes.len(), 4);
    assert!(r.sandboxes.iter().all(|d| d.outcome == "killed"));
    assert_eq!(node.count(), 0);
    assert!(matches!(
        ctl.drain_node("nope", false).await,
        Err(MasterError::NotFound(_))
    ));
    // A drain that cannot reach the node reports every sandbox as an error, drops none.
    let ctl = controller(&url, &[addr2], MasterConfig::default()).await;
    let a = ctl.create(params()).await.unwrap();
    let b = ctl.create(params()).await.unwrap();
    other.sandboxes.lock().unwrap().clear();
    let r = ctl.drain_node("other", false).await.unwrap();
    let mut got: Vec<_> = r
        .sandboxes
        .iter()
        .map(|d| (d.sandbox_id.clone(), d.outcome.clone()))
        .collect();
    got.sort();
    let mut want = vec![(a.id, "error".to_string()), (b.id, "error".to_string())];
    want.sort();
    assert_eq!(got, want);
    assert!(r.sandboxes.iter().all(|d| !d.error.is_empty()));
}
both_backends!(drain_pauses_or_kills_all, super::drain);

/// A client over several peers (a leading master and its standbys, which do not listen) goes on
/// to the one that answers at once, without a backoff, and fails `Unavailable` after one round
/// when none answers (budget zero).
#[tokio::test]
async fn a_client_over_several_peers_uses_the_one_that_answers() {
    use cube_proto::nodev1::node_client::NodeClient;
    use cube_proto::retry::Retrying;
    let node = FakeNode::new("n1");
    let (live, _stop) = serve(node.clone()).await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let ch = |u: &str| {
        tonic::transport::Endpoint::from_shared(u.to_string())
            .unwrap()
            .connect_timeout(Duration::from_secs(1))
            .connect_lazy()
    };
    let mut c = NodeClient::new(Retrying::over(
        vec![ch(&closed), ch(&live)],
        Duration::ZERO,
        "node",
    ));
    let t = std::time::Instant::now();
    for _ in 0..5 {
        let s = c
            .node_status(cube_proto::nodev1::NodeStatusRequest {})
            .await
            .unwrap();
        assert_eq!(s.into_inner().node_id, "n1");
    }
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let mut none = NodeClient::new(Retrying::over(
        vec![ch(&closed), ch(&closed)],
        Duration::ZERO,
        "node",
    ));
    let e = none
        .node_status(cube_proto::nodev1::NodeStatusRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    assert!(e.message().contains("node unreachable"), "{e}");
}
