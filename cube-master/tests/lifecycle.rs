//! E2B lifecycle in the master on both backends: pause instead of kill at the timeout
//! (`autoPause`), paused sandboxes kept for the retention, resume with the create's own timeout,
//! refresh that never shortens, and idempotent creates. Nodes are in-process fake cubelets over
//! real gRPC (tests/common).

#[macro_use]
mod common;

use common::{controller, serve, FakeNode};
use cube_master::ops::{Controller, CreateParams};
use cube_master::state::SandboxState;
use cube_master::{MasterConfig, MasterError};
use cube_proto::nodev1 as pb;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A controller over one fake node that lives as long as the test process.
async fn controller_on(url: &str, node: &Arc<FakeNode>) -> Controller {
    let (addr, stop) = serve(node.clone()).await;
    std::mem::forget(stop);
    controller(url, &[addr], MasterConfig::default()).await
}

fn params(timeout_s: u64) -> CreateParams {
    CreateParams {
        team_id: "t".into(),
        template: "base".into(),
        timeout_s,
        ..Default::default()
    }
}

const DAY_MS: i64 = 24 * 3600 * 1000;

async fn auto_pause_at_the_timeout(url: String) {
    let node = FakeNode::new("lc");
    let ctl = controller_on(&url, &node).await;
    let keep = ctl
        .create(CreateParams {
            auto_pause: true,
            auto_resume: true,
            ..params(600)
        })
        .await
        .unwrap();
    let plain = ctl.create(params(600)).await.unwrap();
    assert_eq!(
        (keep.auto_pause, keep.auto_resume, keep.timeout_s),
        (1, 1, 600)
    );
    assert_eq!(keep.internet(), Some(true));
    // Both reach their end.
    let past = cube_master::now_ms() - 1;
    ctl.db.set_end(&keep.id, past).await.unwrap();
    ctl.db.set_end(&plain.id, past).await.unwrap();
    assert_eq!(ctl.reap_once().await.unwrap(), 2);
    let k = ctl.get("t", &keep.id).await.unwrap();
    assert_eq!(k.state, SandboxState::Paused);
    assert!(k.reason.contains("auto-pause"), "{}", k.reason);
    assert_eq!(
        node.state_of(&keep.id),
        Some(pb::SandboxState::Paused as i32)
    );
    // A paused sandbox's timeout no longer runs: it is kept for the paused retention.
    assert!(
        k.end_at_ms > cube_master::now_ms() + 29 * DAY_MS,
        "{}",
        k.end_at_ms
    );
    assert_eq!(ctl.metrics.auto_paused.get(), 1);
    // The other one was killed, as before.
    assert!(ctl.get("t", &plain.id).await.is_err());
    assert_eq!(node.state_of(&plain.id), None);
    // Nothing more happens on the next passes.
    assert_eq!(ctl.reap_once().await.unwrap(), 0);
    assert_eq!(node.pauses.load(Ordering::SeqCst), 1);
    // A resume by traffic (timeout 0) gives it its own create timeout again.
    let before = cube_master::now_ms();
    let (r, resumed) = ctl.connect("", &keep.id, 0).await.unwrap();
    assert!(resumed);
    assert_eq!(r.state, SandboxState::Running);
    let end = ctl.get("t", &keep.id).await.unwrap().end_at_ms;
    assert!(
        (before + 600_000..before + 610_000).contains(&end),
        "{end} vs {before}"
    );
    // A manual pause keeps it for the retention too.
    ctl.pause("t", &keep.id, false).await.unwrap();
    let p = ctl.get("t", &keep.id).await.unwrap();
    assert!(p.end_at_ms > cube_master::now_ms() + 29 * DAY_MS);
    // autoResume alone cannot be satisfied: refused.
    let e = ctl
        .create(CreateParams {
            auto_resume: true,
            ..params(60)
        })
        .await
        .unwrap_err();
    assert!(matches!(e, MasterError::InvalidArgument(_)), "{e}");
}
both_backends!(auto_pause, super::auto_pause_at_the_timeout);

/// E2B's `memory: false`: a pause that keeps only the filesystem (asked for, or at the
/// timeout with autoPauseMemory false), reported as such; traffic does not restart such a
/// sandbox, a connect does; a connect with a reboot drops a full pause's memory.
async fn filesystem_only_pauses(url: String) {
    let node = FakeNode::new("fs");
    let ctl = controller_on(&url, &node).await;
    let info_mode =
        |r: &cube_master::store::SandboxRow| cube_master::grpc::to_info(&ctl, r).pause_mode;
    let a = ctl.create(params(600)).await.unwrap();
    let p = ctl.pause_with("t", &a.id, false, true).await.unwrap();
    assert_eq!(
        (p.state.as_str(), p.pause_mode.as_str()),
        ("paused", "filesystem")
    );
    assert_eq!(info_mode(&p), "filesystem");
    assert_eq!(node.fs_pauses.load(Ordering::SeqCst), 1);
    // Traffic (a connect with timeout 0) does not restart it; a connect does.
    let e = ctl.connect("", &a.id, 0).await.unwrap_err();
    assert!(
        matches!(&e, MasterError::FailedPrecondition(m) if m.contains("without its memory")),
        "{e}"
    );
    let (r, resumed) = ctl.connect("t", &a.id, 60).await.unwrap();
    assert!(resumed);
    assert_eq!((r.state.as_str(), r.pause_mode.as_str()), ("running", ""));
    assert_eq!(info_mode(&r), "");
    // A full pause, then a connect that asks for a reboot.
    let p = ctl.pause("t", &a.id, false).await.unwrap();
    assert_eq!(info_mode(&p), "full");
    ctl.connect_with("t", &a.id, 60, true).await.unwrap();
    assert_eq!(node.reboots.load(Ordering::SeqCst), 1);
    // A reboot asked of a running sandbox changes nothing.
    let (_, resumed) = ctl.connect_with("t", &a.id, 60, true).await.unwrap();
    assert!(!resumed);
    assert_eq!(node.reboots.load(Ordering::SeqCst), 1);
    // At the timeout, with autoPauseMemory false.
    let b = ctl
        .create(CreateParams {
            auto_pause: true,
            auto_pause_filesystem: true,
            ..params(600)
        })
        .await
        .unwrap();
    ctl.db
        .set_end(&b.id, cube_master::now_ms() - 1)
        .await
        .unwrap();
    assert_eq!(ctl.reap_once().await.unwrap(), 1);
    let b = ctl.get("t", &b.id).await.unwrap();
    assert_eq!(
        (b.state.as_str(), b.pause_mode.as_str()),
        ("paused", "filesystem")
    );
    assert_eq!(node.fs_pauses.load(Ordering::SeqCst), 2);
    // Not with autoResume: traffic could never restart it.
    let e = ctl
        .create(CreateParams {
            auto_pause: true,
            auto_resume: true,
            auto_pause_filesystem: true,
            ..params(60)
        })
        .await
        .unwrap_err();
    assert!(matches!(e, MasterError::InvalidArgument(_)), "{e}");
}
both_backends!(filesystem_only_pause, super::filesystem_only_pauses);

async fn refresh_never_shortens(url: String) {
    let node = FakeNode::new("rf");
    let ctl = controller_on(&url, &node).await;
    let a = ctl.create(params(600)).await.unwrap();
    let end0 = ctl.get("t", &a.id).await.unwrap().end_at_ms;
    let r = ctl.set_timeout("t", &a.id, 5, true).await.unwrap();
    assert_eq!(r.end_at_ms, end0);
    assert_eq!(ctl.get("t", &a.id).await.unwrap().end_at_ms, end0);
    ctl.set_timeout("t", &a.id, 0, true).await.unwrap();
    assert_eq!(ctl.get("t", &a.id).await.unwrap().end_at_ms, end0);
    let r = ctl.set_timeout("t", &a.id, 3600, true).await.unwrap();
    assert!(r.end_at_ms > end0 + 2_000_000);
    // The plain timeout still sets the end either way.
    let r = ctl.set_timeout("t", &a.id, 5, false).await.unwrap();
    assert!(r.end_at_ms < end0);
    assert!(ctl.set_timeout("t", &a.id, 0, false).await.is_err());
}
both_backends!(refresh, super::refresh_never_shortens);

async fn idempotent_creates(url: String) {
    let node = FakeNode::new("ik");
    let ctl = Arc::new(controller_on(&url, &node).await);
    let keyed = |key: &str| CreateParams {
        idempotency_key: key.into(),
        ..params(60)
    };
    // Concurrent retries of one create make one sandbox.
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let ctl = ctl.clone();
            let p = keyed("k-1");
            tokio::spawn(async move { ctl.create(p).await })
        })
        .collect();
    let mut ids = Vec::new();
    for t in tasks {
        ids.push(t.await.unwrap().unwrap().id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(node.creates.load(Ordering::SeqCst), 1);
    // The envd version is the one the node reported for the sandbox's agent.
    let row = ctl.get("t", &ids[0]).await.unwrap();
    assert_eq!(row.envd_version, common::FAKE_ENVD_VERSION);
    assert_eq!(ctl.metrics.idempotent_replays.get(), 3);
    // A later retry answers with it too; the same key for another request is refused.
    assert_eq!(ctl.create(keyed("k-1")).await.unwrap().id, ids[0]);
    let other = CreateParams {
        timeout_s: 61,
        ..keyed("k-1")
    };
    let e = ctl.create(other).await.unwrap_err();
    assert!(matches!(e, MasterError::FailedPrecondition(_)), "{e}");
    // Keys are per team.
    let u = CreateParams {
        team_id: "u".into(),
        ..keyed("k-1")
    };
    assert_ne!(ctl.create(u).await.unwrap().id, ids[0]);
    // A create that failed leaves the key free for a retry (even a corrected one).
    let bad = CreateParams {
        template: "nope".into(),
        ..keyed("k-2")
    };
    assert!(matches!(
        ctl.create(bad).await,
        Err(MasterError::NotFound(_))
    ));
    let fixed = ctl.create(keyed("k-2")).await.unwrap();
    assert_eq!(fixed.state, SandboxState::Running);
    // Once its sandbox is killed, the key answers that (rather than a dead sandbox).
    ctl.kill("t", &ids[0], "test").await.unwrap();
    let e = ctl.create(keyed("k-1")).await.unwrap_err();
    assert!(e.to_string().contains("killed"), "{e}");
}
both_backends!(idempotency, super::idempotent_creates);

/// E2B egress rules: the node's switch gets them with E2B's precedence compiled in, the
/// update replaces all of them (on a running and on a paused sandbox), a fork keeps them, and
/// the record only changes when the node took the new rules.
async fn egress_rules(url: String) {
    let node = FakeNode::new("eg");
    let ctl = controller_on(&url, &node).await;
    let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let rules = cube_master::egress::Rules::parse(
        &v(&["1.1.1.1", "8.8.0.0/16"]),
        &v(&["0.0.0.0/0", "8.8.8.8"]),
        None,
    )
    .unwrap();
    let row = ctl
        .create(CreateParams {
            egress: rules.clone(),
            ..params(600)
        })
        .await
        .unwrap();
    assert_eq!(row.egress(), rules);
    assert_eq!(
        node.egress.lock().unwrap()[&row.id],
        (false, v(&["1.1.1.1/32", "8.8.0.0/16"]), v(&[])),
        "deny-all is the switch's internet off; an allow covering a deny wins"
    );
    // Replace everything: omitted lists are cleared.
    let deny = cube_master::egress::Rules::parse(&[], &v(&["9.9.9.9"]), None).unwrap();
    let up = ctl
        .update_network("t", &row.id, true, deny.clone())
        .await
        .unwrap();
    assert_eq!((up.egress(), up.internet()), (deny.clone(), Some(true)));
    assert_eq!(
        node.egress.lock().unwrap()[&row.id],
        (true, v(&[]), v(&["9.9.9.9/32"]))
    );
    // Domain names with DNS servers of the user's: each server is an allowed address (it
    // beats a deny that names it), and the record keeps the servers (also an empty list).
    let named = cube_master::egress::Rules::parse(
        &v(&["Example.COM."]),
        &v(&["0.0.0.0/0", "1.1.1.1"]),
        Some(&v(&["1.1.1.1"])),
    )
    .unwrap();
    let up = ctl
        .update_network("t", &row.id, true, named.clone())
        .await
        .unwrap();
    assert_eq!(up.egress(), named);
    assert_eq!(up.dns_servers.as_deref(), Some("1.1.1.1"));
    assert_eq!(
        node.egress.lock().unwrap()[&row.id],
        (false, v(&["1.1.1.1/32"]), v(&[]))
    );
    let no_dns = cube_master::egress::Rules::parse(&v(&["example.com"]), &[], Some(&[])).unwrap();
    let up = ctl
        .update_network("t", &row.id, true, no_dns.clone())
        .await
        .unwrap();
    assert_eq!((up.egress(), up.dns_servers.as_deref()), (no_dns, Some("")));
    // Another team's sandbox is not found; a paused one takes the update too.
    let e = ctl
        .update_network("other", &row.id, true, Default::default())
        .await
        .unwrap_err();
    assert!(matches!(e, MasterError::NotFound(_)), "{e:?}");
    ctl.pause("t", &row.id, false).await.unwrap();
    ctl.update_network("t", &row.id, false, Default::default())
        .await
        .unwrap();
    assert_eq!(
        node.egress.lock().unwrap()[&row.id],
        (false, v(&[]), v(&[]))
    );
    let got = ctl.get("t", &row.id).await.unwrap();
    assert_eq!(
        (got.internet(), got.egress()),
        (Some(false), Default::default())
    );
    // A node that refuses the rules leaves the record as it was.
    node.sandboxes.lock().unwrap().remove(&row.id);
    assert!(ctl
        .update_network("t", &row.id, true, deny.clone())
        .await
        .is_err());
    let got = ctl.get("t", &row.id).await.unwrap();
    assert_eq!(
        (got.internet(), got.egress()),
        (Some(false), Default::default())
    );
    // Killed: no more updates.
    let other = ctl.create(params(600)).await.unwrap();
    ctl.kill("t", &other.id, "test").await.unwrap();
    assert!(ctl
        .update_network("t", &other.id, true, deny)
        .await
        .is_err());
}

both_backends!(egress, super::egress_rules);

/// A sandbox's log is read from the node it ran on, also once it was killed (the node keeps it
/// for its retention); another team never sees it.
async fn history_outlives_the_sandbox(url: String) {
    let node = FakeNode::new("hist");
    let ctl = controller_on(&url, &node).await;
    let row = ctl.create(params(600)).await.unwrap();
    let q = || cube_proto::nodev1::SandboxLogsRequest {
        sandbox_id: row.id.clone(),
        ..Default::default()
    };
    let live = ctl.sandbox_logs("t", q()).await.unwrap();
    assert_eq!(live.entries[0].message, format!("log of {}", row.id));
    assert!(ctl.kill("t", &row.id, "test").await.unwrap());
    assert!(matches!(
        ctl.get("t", &row.id).await.unwrap_err(),
        MasterError::NotFound(_)
    ));
    let after = ctl.sandbox_logs("t", q()).await.unwrap();
    assert_eq!(after.entries.len(), 1, "asked of its node after the kill");
    let e = ctl.sandbox_logs("other", q()).await.unwrap_err();
    assert!(matches!(e, MasterError::NotFound(_)), "{e:?}");
    let e = ctl
        .sandbox_logs(
            "t",
            cube_proto::nodev1::SandboxLogsRequest {
                sandbox_id: "nosuchsandbox".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(e, MasterError::NotFound(_)), "{e:?}");
}
both_backends!(history, super::history_outlives_the_sandbox);

/// A strict pause (requireHealthyGuest) asks the node first: an agent that does not answer
/// leaves the sandbox running and the pause refused as Unavailable (503); a plain pause does
/// not ask.
async fn strict_pause_needs_a_healthy_guest(url: String) {
    let node = FakeNode::new("strict");
    let ctl = controller_on(&url, &node).await;
    let row = ctl.create(params(600)).await.unwrap();
    node.unhealthy.lock().unwrap().insert(row.id.clone());
    let e = ctl.pause("t", &row.id, true).await.unwrap_err();
    assert!(
        matches!(e, MasterError::Unavailable(ref m) if m.contains("does not answer")),
        "{e:?}"
    );
    assert_eq!(
        ctl.get("t", &row.id).await.unwrap().state,
        SandboxState::Running
    );
    assert_eq!(node.pauses.load(std::sync::atomic::Ordering::SeqCst), 0);
    node.unhealthy.lock().unwrap().clear();
    let p = ctl.pause("t", &row.id, true).await.unwrap();
    assert_eq!(p.state, SandboxState::Paused);
    // A plain pause of an unresponsive one goes ahead (E2B's default).
    let other = ctl.create(params(600)).await.unwrap();
    node.unhealthy.lock().unwrap().insert(other.id.clone());
    assert_eq!(
        ctl.pause("t", &other.id, false).await.unwrap().state,
        SandboxState::Paused
    );
}
both_backends!(strict_pause, super::strict_pause_needs_a_healthy_guest);
