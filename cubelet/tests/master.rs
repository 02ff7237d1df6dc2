//! A real cubelet registering with a real cube-master (the master's library served in-process
//! on its own port and SQLite file): join token, heartbeats carrying templates, scheduling onto
//! the node, drain, crash → not ready → sandbox lost, restart → re-registration with the saved
//! node secret (the token is spent) → sandbox reconciled, kill through the master.

mod common;

use common::{Cubelet, Opts};
use cube_master::fleet::Nodes;
use cube_master::grpc::{self, MasterService};
use cube_master::ops::{Controller, CreateParams};
use cube_master::state::SandboxState;
use cube_master::store::Db;
use cube_master::MasterConfig;
use std::sync::Arc;
use std::time::{Duration, Instant};

async fn until<F: Fn() -> bool>(what: &str, secs: u64, f: F) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(secs), "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn state(ctl: &Controller, id: &str) -> (String, String) {
    let r = ctl.db.get_sandbox(id).await.unwrap().unwrap();
    (r.state.to_string(), r.reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cubelet_registers_heartbeats_and_is_reconciled() {
    cube_testkit::require_priv!("cubelet::master_registration");
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(&format!("sqlite://{}/m.db", dir.path().display()))
        .await
        .unwrap();
    let cfg = MasterConfig {
        nodes: vec![],
        require_join_token: true,
        heartbeat_interval_ms: 200,
        node_max_misses: 3,
        default_memory_mib: 256,
        ..Default::default()
    };
    let ctl = Arc::new(Controller::new(cfg, db, Nodes::new(&[], 3).unwrap()));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let master = format!("http://{}", l.local_addr().unwrap());
    let incoming =
        futures::stream::unfold(
            l,
            |l| async move { Some((l.accept().await.map(|(s, _)| s), l)) },
        );
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(MasterService::new(ctl.clone()))
            .serve_with_incoming(incoming),
    );
    tokio::spawn(ctl.clone().run_node_health(Duration::from_millis(100)));
    let (token, _) = ctl.create_join_token(300).await.unwrap();

    let mut c = Cubelet::new(
        "mreg",
        Opts {
            network_pool: 1,
            ..Default::default()
        },
    );
    let mut cfg = std::fs::read_to_string(&c.config).unwrap();
    cfg.push_str(&format!(
        "\n[master]\naddress = \"{master}\"\njoin_token = \"{token}\"\n"
    ));
    std::fs::write(&c.config, cfg).unwrap();
    c.start().await;
    // Registered, and its first heartbeat delivered the templates.
    let ready_with_mini = |ctl: &Controller| {
        grpc::node_infos(ctl)
            .iter()
            .any(|n| n.status == "ready" && n.templates.iter().any(|t| t == "mini"))
    };
    until("node registered and ready", 20, || ready_with_mini(&ctl)).await;
    let info = grpc::node_infos(&ctl).remove(0);
    assert_eq!(info.origin, "registered");
    assert_eq!(info.address, c.grpc);
    assert!(info.vcpus > 0 && info.memory_mib > 0, "{info:?}");
    assert!(c.data().join("master-link.json").exists());

    let sb = ctl
        .create(CreateParams {
            team_id: "t".into(),
            template: "mini".into(),
            timeout_s: 300,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create through the master: {e}\n{}", c.log()));
    assert_eq!(sb.node_id, info.node_id);
    assert_eq!(sb.state, SandboxState::Running);

    // Drain pauses it and reports it.
    let d = ctl.drain_node(&info.node_id, false).await.unwrap();
    assert_eq!(d.sandboxes.len(), 1);
    assert_eq!(d.sandboxes[0].outcome, "paused", "{:?}", d.sandboxes);
    assert_eq!(state(&ctl, &sb.id).await.0, "paused");
    ctl.set_cordon(&info.node_id, false).await.unwrap();

    // The cubelet dies: the node goes not ready and the sandbox is reported lost.
    c.crash();
    let t = Instant::now();
    loop {
        let (s, reason) = state(&ctl, &sb.id).await;
        if s == "lost" {
            assert!(reason.contains("no heartbeat"), "{reason}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "not lost: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(grpc::node_infos(&ctl)[0].status, "not_ready");

    // It comes back; the join token is spent, the saved secret lets it in again, and the
    // re-adopted sandbox is paused again in the master.
    c.start().await;
    let t = Instant::now();
    loop {
        let (s, _) = state(&ctl, &sb.id).await;
        if s == "paused" {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "not reconciled: {s}\n{}",
            c.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready_with_mini(&ctl));
    assert!(ctl.kill("t", &sb.id, "test").await.unwrap());
    c.stop();
    c.assert_clean();
    assert!(
        !c.log().contains("panicked"),
        "cubelet panicked: {}",
        c.log()
    );
}

/// A cubelet whose master is not there keeps running and serving.
#[tokio::test]
async fn cubelet_runs_without_its_master() {
    cube_testkit::require_priv!("cubelet::master_absent");
    let mut c = Cubelet::new("mabs", Opts::default());
    // Held for this process and never listened on: the master stays absent.
    let port = cube_testkit::reserve_port();
    let mut cfg = std::fs::read_to_string(&c.config).unwrap();
    cfg.push_str(&format!(
        "\n[master]\naddress = \"http://127.0.0.1:{port}\"\n"
    ));
    std::fs::write(&c.config, cfg).unwrap();
    let mut cl = c.start().await;
    // The node keeps serving through a failed registration (it logs it and retries).
    let t = std::time::Instant::now();
    while !c.log().contains("master registration failed") {
        assert!(t.elapsed() < Duration::from_secs(30), "{}", c.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cl.node_status(cube_proto::nodev1::NodeStatusRequest {})
        .await
        .unwrap();
    assert!(c.child.as_mut().unwrap().try_wait().unwrap().is_none());
    c.stop();
}
