//! The database layer on both backends: guarded state transitions, expiry, API keys, nodes
//! and join tokens. Each case runs on SQLite and on PostgreSQL (see tests/common).

#[macro_use]
mod common;

use cube_master::apikey;
use cube_master::state::SandboxState;
use cube_master::store::nodes::{NodeRow, TokenRefusal};
use cube_master::store::{Db, PageQuery, SandboxRow};
use cube_master::MasterError;

fn row(id: &str) -> SandboxRow {
    SandboxRow {
        id: id.into(),
        team_id: "t".into(),
        template: "base".into(),
        build: String::new(),
        state: SandboxState::Creating,
        reason: String::new(),
        node_id: "n1".into(),
        agent_address: String::new(),
        host_interface: String::new(),
        access_token: cube_master::token::stored(&format!("tok-{id}")),
        envd_version: String::new(),
        metadata: String::new(),
        vcpus: 1,
        memory_mib: 1,
        disk_mib: 0,
        runtime: String::new(),
        started_at_ms: 1,
        end_at_ms: 10,
        updated_at_ms: 1,
        auto_pause: 0,
        auto_resume: 0,
        timeout_s: 9,
        internet: 1,
        private_ports: 0,
        mask_request_host: String::new(),
        allow_out: String::new(),
        deny_out: String::new(),
        dns_servers: None,
        pause_mode: String::new(),
        auto_pause_filesystem: 0,
    }
}

async fn guarded_transitions_and_expiry(url: String) {
    let db = Db::open(&url).await.unwrap();
    db.insert_sandbox(&row("a")).await.unwrap();
    use SandboxState::*;
    assert!(db.transition("a", Creating, Running, "ok").await.unwrap());
    // A second writer that still believes it is creating does not move it.
    assert!(!db.transition("a", Creating, Failed, "late").await.unwrap());
    // Illegal steps are refused before touching the database.
    assert!(db.transition("a", Running, Paused, "skip").await.is_err());
    let r = db.get_sandbox("a").await.unwrap().unwrap();
    assert_eq!((r.state.as_str(), r.reason.as_str()), ("running", "ok"));
    assert_eq!(db.expired(9).await.unwrap(), Vec::<String>::new());
    assert_eq!(db.expired(10).await.unwrap(), vec!["a".to_string()]);
    // Rows hold the token's hash; the plain token itself is not stored.
    let hashed = cube_master::token::stored("tok-a");
    assert_eq!(
        db.by_access_token(&hashed, "").await.unwrap().unwrap().id,
        "a"
    );
    assert!(db.by_access_token("", "tok-a").await.unwrap().is_none());
    // Lost sandboxes still expire, and are no longer reachable by token.
    assert!(db
        .transition("a", Running, Lost, "node gone")
        .await
        .unwrap());
    assert_eq!(db.expired(10).await.unwrap(), vec!["a".to_string()]);
    assert!(db.by_access_token(&hashed, "").await.unwrap().is_none());
    assert_eq!(db.sandboxes_on_node("n1").await.unwrap().len(), 1);
    let counts = db.count_by_state().await.unwrap();
    assert_eq!(counts, vec![(Lost, 1)]);
    // Duplicate ids are rejected by the primary key.
    assert!(db.insert_sandbox(&row("a")).await.is_err());
    // Reopening keeps the data (migrations are not re-applied).
    drop(db);
    let db = Db::open(&url).await.unwrap();
    assert!(db.get_sandbox("a").await.unwrap().is_some());
}
both_backends!(transitions, super::guarded_transitions_and_expiry);

async fn list_in_states_orders_and_filters(url: String) {
    let db = Db::open(&url).await.unwrap();
    for (i, id) in ["c", "a", "b"].iter().enumerate() {
        let mut r = row(id);
        r.started_at_ms = 100 - i as i64;
        db.insert_sandbox(&r).await.unwrap();
    }
    db.transition("a", SandboxState::Creating, SandboxState::Running, "")
        .await
        .unwrap();
    let all = db.list_in_states(&[SandboxState::Creating]).await.unwrap();
    let ids: Vec<_> = all.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["b", "c"]);
}
both_backends!(list_in_states, super::list_in_states_orders_and_filters);

async fn pages_filter_in_sql_and_killed_rows_are_purged(url: String) {
    let db = Db::open(&url).await.unwrap();
    // s0..s9 started at 10..19 (two share a start time, so the id breaks the tie); odd ones
    // belong to team u, s8 and s9 use another template, s0 and s1 get killed.
    for i in 0..10 {
        let mut r = row(&format!("s{i}"));
        r.started_at_ms = 10 + i64::from(i) - i64::from(i == 5);
        r.team_id = if i % 2 == 1 { "u".into() } else { "t".into() };
        if i >= 8 {
            r.template = "other".into();
        }
        db.insert_sandbox(&r).await.unwrap();
        db.transition(&r.id, SandboxState::Creating, SandboxState::Running, "")
            .await
            .unwrap();
    }
    for id in ["s0", "s1"] {
        db.transition(id, SandboxState::Running, SandboxState::Killing, "")
            .await
            .unwrap();
        db.transition(id, SandboxState::Killing, SandboxState::Killed, "")
            .await
            .unwrap();
    }
    let running = [SandboxState::Running];
    let ids = |v: Vec<SandboxRow>| v.into_iter().map(|r| r.id).collect::<Vec<_>>();
    // Newest first, five at a time (the first page ends between the two rows started at
    // 14), each page after the previous page's last row.
    let mut seen = vec![];
    let mut cursor = None;
    loop {
        let page = db
            .page_sandboxes(&PageQuery {
                states: &running,
                cursor: cursor.clone(),
                limit: 5,
                ..PageQuery::default()
            })
            .await
            .unwrap();
        if page.is_empty() {
            break;
        }
        cursor = page.last().map(|r| (r.started_at_ms, r.id.clone()));
        seen.extend(ids(page));
    }
    assert_eq!(seen, ["s9", "s8", "s7", "s6", "s5", "s4", "s3", "s2"]);
    let team_u = db
        .page_sandboxes(&PageQuery {
            states: &running,
            team_id: "u",
            ascending: true,
            ..PageQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(team_u), ["s3", "s5", "s7", "s9"]);
    let other = db
        .page_sandboxes(&PageQuery {
            states: &running,
            template: "other",
            ..PageQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(other), ["s9", "s8"]);
    // `startedAfter` is "at or after" (the SDK's words): s4 and s5 both started at 14.
    let later = db
        .page_sandboxes(&PageQuery {
            states: &running,
            started_after_ms: 14,
            ..PageQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(ids(later), ["s9", "s8", "s7", "s6", "s5", "s4"]);
    // Only killed rows older than the cut-off go.
    let now = cube_master::now_ms();
    assert_eq!(db.purge_killed(now - 3_600_000).await.unwrap(), 0);
    assert_eq!(db.purge_killed(now + 1).await.unwrap(), 2);
    assert!(db.get_sandbox("s0").await.unwrap().is_none());
    assert!(db.get_sandbox("s2").await.unwrap().is_some());
}
both_backends!(
    paging,
    super::pages_filter_in_sql_and_killed_rows_are_purged
);

async fn idempotency_keys_claim_once_per_team(url: String) {
    let db = Db::open(&url).await.unwrap();
    assert_eq!(
        db.claim_idempotency_key("t", "k1", "sa", "fp")
            .await
            .unwrap(),
        None
    );
    // A second claim (another request, or another master on the same database) sees the first.
    assert_eq!(
        db.claim_idempotency_key("t", "k1", "sb", "fp2")
            .await
            .unwrap(),
        Some(("sa".to_string(), "fp".to_string()))
    );
    // Keys are per team.
    assert_eq!(
        db.claim_idempotency_key("u", "k1", "sc", "fp")
            .await
            .unwrap(),
        None
    );
    // A release by a create that no longer holds the key leaves it alone.
    db.release_idempotency_key("t", "k1", "sb").await.unwrap();
    assert_eq!(
        db.claim_idempotency_key("t", "k1", "sb", "fp")
            .await
            .unwrap(),
        Some(("sa".to_string(), "fp".to_string()))
    );
    // Released (its create failed), the key can be claimed again.
    db.release_idempotency_key("t", "k1", "sa").await.unwrap();
    assert_eq!(
        db.claim_idempotency_key("t", "k1", "sd", "fp")
            .await
            .unwrap(),
        None
    );
    // A key cube-api made up for its own resends goes long before a client's.
    let retry_key = format!("{}1-2", cube_proto::RETRY_IDEMPOTENCY_PREFIX);
    assert_eq!(
        db.claim_idempotency_key("t", &retry_key, "sf", "fp")
            .await
            .unwrap(),
        None
    );
    let now = cube_master::now_ms();
    assert_eq!(
        db.purge_idempotency_keys(now - 60_000, now - 60_000)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        db.purge_idempotency_keys(now - 60_000, now + 1)
            .await
            .unwrap(),
        1,
        "only the made-up key"
    );
    assert_eq!(
        db.claim_idempotency_key("t", &retry_key, "sg", "fp")
            .await
            .unwrap(),
        None,
        "purged"
    );
    assert_eq!(db.purge_idempotency_keys(i64::MAX, 0).await.unwrap(), 3);
    assert_eq!(
        db.claim_idempotency_key("t", "k1", "se", "fp")
            .await
            .unwrap(),
        None
    );
    // At a master's start, keys whose create never recorded its sandbox go; a key whose
    // sandbox has a row stays.
    db.insert_sandbox(&row("held")).await.unwrap();
    for (k, id) in [("k-rowless", "never-inserted"), ("k-held", "held")] {
        assert_eq!(
            db.claim_idempotency_key("t", k, id, "fp").await.unwrap(),
            None
        );
    }
    // A key claimed after the bound may belong to a create in flight: it stays.
    assert_eq!(
        db.release_unrecorded_idempotency_keys(cube_master::now_ms() - 60_000)
            .await
            .unwrap(),
        0
    );
    assert!(
        db.release_unrecorded_idempotency_keys(cube_master::now_ms() + 1)
            .await
            .unwrap()
            >= 1
    );
    assert_eq!(
        db.claim_idempotency_key("t", "k-rowless", "x", "fp")
            .await
            .unwrap(),
        None,
        "released"
    );
    assert_eq!(
        db.claim_idempotency_key("t", "k-held", "x", "fp")
            .await
            .unwrap(),
        Some(("held".to_string(), "fp".to_string()))
    );
    // The lifecycle columns round-trip.
    let mut r = row("lc");
    r.auto_pause = 1;
    r.auto_resume = 1;
    r.timeout_s = 42;
    r.internet = 0;
    r.private_ports = 1;
    r.mask_request_host = "localhost:${PORT}".into();
    r.allow_out = "1.1.1.1/32,8.8.0.0/16".into();
    r.deny_out = "0.0.0.0/0".into();
    r.dns_servers = Some("1.1.1.1,8.8.8.8".into());
    db.insert_sandbox(&r).await.unwrap();
    let got = db.get_sandbox("lc").await.unwrap().unwrap();
    assert_eq!((got.auto_pause, got.auto_resume, got.timeout_s), (1, 1, 42));
    assert_eq!(got.internet(), Some(false));
    assert_eq!(got.private_ports, 1);
    assert_eq!(got.mask_request_host, "localhost:${PORT}");
    assert_eq!(got.egress().allow_out, ["1.1.1.1/32", "8.8.0.0/16"]);
    assert_eq!(
        got.egress().dns_servers,
        Some(vec!["1.1.1.1".to_string(), "8.8.8.8".to_string()])
    );
    // The update replaces internet and both lists.
    db.set_egress("lc", true, &Default::default())
        .await
        .unwrap();
    let got = db.get_sandbox("lc").await.unwrap().unwrap();
    assert_eq!(
        (
            got.internet(),
            got.allow_out.as_str(),
            got.deny_out.as_str()
        ),
        (Some(true), "", "")
    );
    assert_eq!(got.dns_servers, None, "dnsServers left out are cleared");
    // An empty list (no DNS at all) is not the same as none given.
    let no_dns = cube_master::egress::Rules {
        dns_servers: Some(vec![]),
        ..Default::default()
    };
    db.set_egress("lc", true, &no_dns).await.unwrap();
    let got = db.get_sandbox("lc").await.unwrap().unwrap();
    assert_eq!(got.egress().dns_servers, Some(vec![]));
}
both_backends!(idempotency, super::idempotency_keys_claim_once_per_team);

async fn api_keys(url: String) {
    let db = Db::open(&url).await.unwrap();
    let (row, secret) = apikey::create(&db, "ci", "").await.unwrap();
    assert!(apikey::well_formed(&secret));
    assert_ne!(row.key_sha256, secret);
    assert_eq!(apikey::validate(&db, &secret).await.unwrap().id, row.id);
    let wrong = format!("e2b_{}", "0".repeat(40));
    assert!(matches!(
        apikey::validate(&db, &wrong).await,
        Err(MasterError::Unauthenticated(_))
    ));
    assert!(db.revoke_api_key(&row.id).await.unwrap());
    assert!(!db.revoke_api_key(&row.id).await.unwrap());
    assert!(matches!(
        apikey::validate(&db, &secret).await,
        Err(MasterError::Unauthenticated(_))
    ));
}
both_backends!(api_key_lifecycle, super::api_keys);

async fn nodes_and_tokens(url: String) {
    let db = Db::open(&url).await.unwrap();
    let mut n = NodeRow {
        node_id: "n1".into(),
        address: "http://10.0.0.1:9091".into(),
        origin: "registered".into(),
        secret_sha256: "h1".into(),
        cordoned: 0,
        version: "0.1.0".into(),
        runtime: "namespace".into(),
        kvm_kind: "pvm".into(),
        vcpus: 4,
        memory_mib: 8192,
        max_sandboxes: 10,
        registered_at_ms: 5,
        last_seen_ms: 5,
    };
    db.upsert_registered_node(&n).await.unwrap();
    assert!(db.set_cordoned("n1", true).await.unwrap());
    assert!(!db.set_cordoned("nope", true).await.unwrap());
    // Re-registration updates the row but keeps the cordon.
    n.address = "http://10.0.0.2:9091".into();
    n.secret_sha256 = "h2".into();
    db.upsert_registered_node(&n).await.unwrap();
    let r = db.get_node("n1").await.unwrap().unwrap();
    assert_eq!(
        (r.address.as_str(), r.secret_sha256.as_str(), r.cordoned),
        ("http://10.0.0.2:9091", "h2", 1)
    );
    db.upsert_static_node("s1", "http://127.0.0.1:9091")
        .await
        .unwrap();
    db.upsert_static_node("s1", "http://127.0.0.1:9092")
        .await
        .unwrap();
    let all = db.list_nodes().await.unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[1].address, "http://127.0.0.1:9092");
    assert_eq!(all[1].origin, "static");

    db.insert_join_token("t1", 100, 1000).await.unwrap();
    db.insert_join_token("t2", 100, 200).await.unwrap();
    assert_eq!(
        db.consume_join_token("t1", "n1", 150).await.unwrap(),
        Ok(())
    );
    assert_eq!(
        db.consume_join_token("t1", "n2", 160).await.unwrap(),
        Err(TokenRefusal::Used)
    );
    assert_eq!(
        db.consume_join_token("t2", "n2", 200).await.unwrap(),
        Err(TokenRefusal::Expired)
    );
    assert_eq!(
        db.consume_join_token("zz", "n2", 100).await.unwrap(),
        Err(TokenRefusal::Unknown)
    );
}
both_backends!(node_rows_and_join_tokens, super::nodes_and_tokens);

async fn one_token_one_winner(url: String) {
    let db = Db::open(&url).await.unwrap();
    db.insert_join_token("t", 0, i64::MAX).await.unwrap();
    let tries = (0..8).map(|i| {
        let db = db.clone();
        async move {
            db.consume_join_token("t", &format!("n{i}"), 1)
                .await
                .unwrap()
        }
    });
    let results = futures_util::future::join_all(tries).await;
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
}
both_backends!(concurrent_token_use, super::one_token_one_winner);

#[tokio::test]
async fn bad_urls_are_clear_errors() {
    let e = Db::open("mysql://x").await.err().unwrap().to_string();
    assert!(e.contains("sqlite: or postgres://"), "{e}");
    let e = Db::open("postgres://nobody:x@127.0.0.1:1/none")
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("database"), "{e}");
}

async fn secrets_store(url: String) {
    use cube_master::fleet::Nodes;
    use cube_master::ops::Controller;
    use cube_master::secrets::SecretsKey;
    use cube_master::MasterConfig;
    use std::collections::BTreeMap;
    let db = Db::open(&url).await.unwrap();
    let key = SecretsKey::random();
    let ctl = Controller::new(
        MasterConfig::default(),
        db.clone(),
        Nodes::new(&[], 3).unwrap(),
    )
    .with_secrets_key(key);
    let meta: BTreeMap<String, String> = [("env".to_string(), "prod".to_string())].into();
    let a = ctl
        .create_secret("t1", "Alpha", "plain-alpha-value", &meta)
        .await
        .unwrap();
    assert!(a.id.starts_with("sec_"));
    assert_eq!((a.name.as_str(), a.version), ("alpha", 1));
    let b = ctl
        .create_secret("t1", "beta", "plain-beta-value", &BTreeMap::new())
        .await
        .unwrap();
    let c = ctl
        .create_secret("t1", "gamma", "plain-gamma-value", &BTreeMap::new())
        .await
        .unwrap();
    // Names are unique per team (case-insensitively: they are stored lower-cased) ...
    assert!(matches!(
        ctl.create_secret("t1", "ALPHA", "x", &BTreeMap::new())
            .await,
        Err(MasterError::AlreadyExists(_))
    ));
    // ... not across teams.
    let other = ctl
        .create_secret("t2", "alpha", "plain-other-value", &BTreeMap::new())
        .await
        .unwrap();
    assert!(matches!(
        ctl.create_secret("t1", "a{b}", "x", &BTreeMap::new()).await,
        Err(MasterError::InvalidArgument(_))
    ));
    assert!(matches!(
        ctl.create_secret("t1", "empty-value", "", &BTreeMap::new())
            .await,
        Err(MasterError::InvalidArgument(_))
    ));

    // Pages of two, in creation order (ties broken by id), then the rest.
    let (p1, tok) = ctl.list_secrets("t1", 2, "").await.unwrap();
    assert_eq!(p1.len(), 2);
    assert!(!tok.is_empty());
    let (p2, tok2) = ctl.list_secrets("t1", 2, &tok).await.unwrap();
    assert_eq!(p2.len(), 1);
    assert!(tok2.is_empty());
    let mut expect = [a.clone(), b.clone(), c.clone()];
    expect.sort_by(|x, y| (x.created_at_ms, &x.id).cmp(&(y.created_at_ms, &y.id)));
    let got: Vec<String> = p1.iter().chain(&p2).map(|r| r.id.clone()).collect();
    assert_eq!(got, expect.iter().map(|r| r.id.clone()).collect::<Vec<_>>());
    assert!(ctl.list_secrets("t1", 2, "garbage").await.is_err());
    let (all, _) = ctl.list_secrets("t1", 0, "").await.unwrap();
    assert_eq!(all.len(), 3);

    // By id and by name (any case).
    assert_eq!(ctl.get_secret("t1", &a.id).await.unwrap(), a);
    assert_eq!(ctl.get_secret("t1", "alpha").await.unwrap(), a);
    assert_eq!(ctl.get_secret("t1", "ALPHA").await.unwrap(), a);
    assert_eq!(ctl.get_secret("t2", "alpha").await.unwrap().id, other.id);
    // Another team's secret is not found, by id or name.
    assert!(matches!(
        ctl.get_secret("t2", &a.id).await,
        Err(MasterError::NotFound(_))
    ));
    assert!(matches!(
        ctl.get_secret("t3", "beta").await,
        Err(MasterError::NotFound(_))
    ));
    assert!(ctl.list_secrets("t3", 0, "").await.unwrap().0.is_empty());
    assert!(matches!(
        ctl.update_secret("t2", &b.id, "x", None).await,
        Err(MasterError::NotFound(_))
    ));
    assert!(matches!(
        ctl.delete_secret("t2", &b.id).await,
        Err(MasterError::NotFound(_))
    ));

    // An update is the next version; metadata is kept unless given, replaced when given.
    let a2 = ctl
        .update_secret("t1", "alpha", "plain-alpha-two", None)
        .await
        .unwrap();
    assert_eq!((a2.id.as_str(), a2.version), (a.id.as_str(), 2));
    assert_eq!(
        cube_master::grpc::secret_info(&a2)
            .metadata
            .get("env")
            .map(String::as_str),
        Some("prod")
    );
    let new_meta: BTreeMap<String, String> = [("k".to_string(), "v".to_string())].into();
    let a3 = ctl
        .update_secret("t1", &a.id, "plain-alpha-three", Some(&new_meta))
        .await
        .unwrap();
    assert_eq!(a3.version, 3);
    assert_eq!(
        cube_master::grpc::secret_info(&a3)
            .metadata
            .into_iter()
            .collect::<BTreeMap<_, _>>(),
        new_meta
    );
    assert!(a3.updated_at_ms >= a.updated_at_ms);
    assert_eq!(a3.created_at_ms, a.created_at_ms);
    let stored = db.get_secret("t1", &a.id).await.unwrap().unwrap();
    assert_eq!(stored, a3);
    // A stale writer does not move the row.
    assert!(!db.update_secret(&a3, 1).await.unwrap());

    // What the database holds is sealed: no plaintext anywhere in the table.
    let rows: Vec<(String, String, String)> =
        sqlx::query_as("SELECT id, sealed, metadata FROM secrets")
            .fetch_all(&sqlx::AnyPool::connect(&url).await.unwrap())
            .await
            .unwrap();
    assert_eq!(rows.len(), 4);
    for (id, sealed, _) in &rows {
        assert!(sealed.starts_with("v1:"), "{id}: {sealed}");
        assert!(!sealed.contains("plain-"), "{id}: {sealed}");
    }

    // Delete, by name or id; then it is gone.
    ctl.delete_secret("t1", "beta").await.unwrap();
    assert!(matches!(
        ctl.get_secret("t1", &b.id).await,
        Err(MasterError::NotFound(_))
    ));
    assert!(matches!(
        ctl.delete_secret("t1", &b.id).await,
        Err(MasterError::NotFound(_))
    ));
    ctl.delete_secret("t1", &c.id).await.unwrap();
    let (left, _) = ctl.list_secrets("t1", 0, "").await.unwrap();
    assert_eq!(
        left.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
        vec![a.id.clone()]
    );
    // The name is free again once deleted.
    ctl.create_secret("t1", "beta", "again", &BTreeMap::new())
        .await
        .unwrap();
    assert_eq!(ctl.get_secret("t2", "alpha").await.unwrap().version, 1);
}

both_backends!(secrets_crud, super::secrets_store);
