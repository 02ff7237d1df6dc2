//! Shared test support: a database per test on each backend (SQLite always; PostgreSQL when
//! `CUBE_TEST_PG_URL` is set, see deploy/postgres-test.sh), and an in-process fake cubelet.
#![allow(dead_code)]

use cube_proto::nodev1 as pb;
use cube_proto::nodev1::node_server::{Node, NodeServer};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// One test's database. PostgreSQL tests get a schema of their own (dropped on drop), so tests
/// run in parallel against one database.
pub struct TestDb {
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    pg: Option<(String, String)>,
    /// Logs the PostgreSQL test as ran when it ends (the database lives as long as the test).
    _gate: Option<cube_testkit::Gate>,
}

impl TestDb {
    pub fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().expect("tempdir");
        TestDb {
            url: format!("sqlite://{}/m.db", dir.path().display()),
            _dir: Some(dir),
            pg: None,
            _gate: None,
        }
    }

    /// A fresh schema in the CUBE_TEST_PG_URL database; `None` (test skipped, with the
    /// reason printed) when the variable is unset, unless CUBE_REQUIRE_PRIV=1 asks for every
    /// suite: then the test fails.
    pub async fn postgres(test: &str) -> Option<TestDb> {
        let base = match std::env::var("CUBE_TEST_PG_URL") {
            Ok(u) if !u.is_empty() => u,
            _ => {
                let why = "CUBE_TEST_PG_URL is not set (export CUBE_TEST_PG_URL=\"$(deploy/postgres-test.sh)\")";
                let required = std::env::var("CUBE_REQUIRE_PRIV")
                    .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
                    .unwrap_or(false);
                suite_log(&format!(
                    "{} postgres {test}: {why}",
                    if required { "FAILED " } else { "SKIPPED" }
                ));
                if required {
                    panic!("{test}: PostgreSQL required (CUBE_REQUIRE_PRIV=1) but {why}");
                }
                eprintln!("SKIPPED {test}: {why}");
                return None;
            }
        };
        use sqlx::Connection;
        let schema = format!(
            "t_{}_{}_{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst),
            rand::random::<u32>()
        );
        let mut c = sqlx::PgConnection::connect(&base)
            .await
            .unwrap_or_else(|e| panic!("{test}: connecting to CUBE_TEST_PG_URL: {e}"));
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut c)
            .await
            .expect("create schema");
        let _ = c.close().await;
        let sep = if base.contains('?') { '&' } else { '?' };
        Some(TestDb {
            url: format!("{base}{sep}options[search_path]={schema}"),
            _dir: None,
            pg: Some((base, schema)),
            _gate: Some(cube_testkit::Gate::new("postgres", test)),
        })
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Some((base, schema)) = self.pg.take() else {
            return;
        };
        // Drop runs inside the test's runtime: use a thread with a runtime of its own.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                use sqlx::Connection;
                if let Ok(mut c) = sqlx::PgConnection::connect(&base).await {
                    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                        .execute(&mut c)
                        .await;
                    let _ = c.close().await;
                }
            });
        })
        .join();
    }
}

fn suite_log(line: &str) {
    cube_testkit::log_line(line);
}

/// Runs `$body(url)` once per backend: `mod $name { sqlite, postgres }`.
#[macro_export]
macro_rules! both_backends {
    ($name:ident, $body:path) => {
        mod $name {
            #[tokio::test]
            async fn sqlite() {
                let db = $crate::common::TestDb::sqlite();
                $body(db.url.clone()).await;
            }
            #[tokio::test]
            async fn postgres() {
                let Some(db) =
                    $crate::common::TestDb::postgres(concat!(module_path!(), "::postgres")).await
                else {
                    return;
                };
                $body(db.url.clone()).await;
            }
        }
    };
}

/// What a node's switch holds for one sandbox: (internet, allow CIDRs, deny CIDRs).
pub type Egress = (bool, Vec<String>, Vec<String>);

/// A fake cubelet: keeps sandboxes in memory, pauses and resumes them, answers NodeStatus.
#[derive(Default)]
pub struct FakeNode {
    pub id: String,
    pub max: u32,
    pub templates: Vec<String>,
    pub fail_create: bool,
    /// How long each create takes (a real node clones, starts, initialises).
    pub create_delay_ms: u64,
    /// Behaves as a node from before `timeout_ms`: keeps the create's `end_at_ms`.
    pub ignores_timeout: bool,
    pub sandboxes: Mutex<BTreeMap<String, i32>>,
    /// When each sandbox was created (unix ms; absent = 0, long ago).
    pub created_ms: Mutex<BTreeMap<String, u64>>,
    /// The end time the master last set for each (SetEndTime).
    pub ends: Mutex<BTreeMap<String, u64>>,
    pub creates: AtomicU32,
    pub pauses: AtomicU32,
    /// Pauses that asked for the filesystem only, and resumes that asked for a reboot.
    pub fs_pauses: AtomicU32,
    pub reboots: AtomicU32,
    pub kills: AtomicU32,
    /// The egress each sandbox's switch has: (internet, allow CIDRs, deny CIDRs).
    pub egress: Mutex<BTreeMap<String, Egress>>,
    /// Sandboxes whose agent does not answer (GuestHealth says so).
    pub unhealthy: Mutex<std::collections::BTreeSet<String>>,
}

impl FakeNode {
    pub fn new(id: &str) -> Arc<FakeNode> {
        Arc::new(FakeNode {
            id: id.into(),
            templates: vec!["base".into()],
            ..Default::default()
        })
    }

    pub fn count(&self) -> usize {
        self.sandboxes.lock().unwrap().len()
    }

    pub fn state_of(&self, id: &str) -> Option<i32> {
        self.sandboxes.lock().unwrap().get(id).copied()
    }
}

pub struct Handle(pub Arc<FakeNode>);

type R<T> = Result<Response<T>, Status>;

/// A create of `base` for team `t`, 600 s.
pub fn params() -> cube_master::ops::CreateParams {
    cube_master::ops::CreateParams {
        team_id: "t".into(),
        template: "base".into(),
        timeout_s: 600,
        ..Default::default()
    }
}

/// The envd version the fake node reports for its sandboxes (not the master's default).
pub const FAKE_ENVD_VERSION: &str = "0.9.9";

fn sb(id: &str, state: i32) -> pb::Sandbox {
    pb::Sandbox {
        sandbox_id: id.into(),
        template: "base".into(),
        build: "b1".into(),
        state,
        runtime: "namespace".into(),
        agent_address: "127.0.0.1:1".into(),
        envd_version: FAKE_ENVD_VERSION.into(),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl Node for Handle {
    async fn create_sandbox(&self, r: Request<pb::CreateSandboxRequest>) -> R<pb::Sandbox> {
        self.0.creates.fetch_add(1, Ordering::SeqCst);
        if self.0.fail_create {
            return Err(Status::internal("disk clone failed"));
        }
        if self.0.create_delay_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(self.0.create_delay_ms)).await;
        }
        let r = r.into_inner();
        let st = pb::SandboxState::Running as i32;
        self.0
            .sandboxes
            .lock()
            .unwrap()
            .insert(r.sandbox_id.clone(), st);
        self.0
            .created_ms
            .lock()
            .unwrap()
            .insert(r.sandbox_id.clone(), cube_master::now_ms() as u64);
        // As cubelet does: a timeout counts from when the sandbox is ready.
        let end = if r.timeout_ms > 0 && !self.0.ignores_timeout {
            cube_master::now_ms() as u64 + r.timeout_ms
        } else {
            r.end_at_ms
        };
        self.0
            .ends
            .lock()
            .unwrap()
            .insert(r.sandbox_id.clone(), end);
        let n = r.network.unwrap_or_default();
        self.0.egress.lock().unwrap().insert(
            r.sandbox_id.clone(),
            (n.internet, n.allow_cidrs, n.deny_cidrs),
        );
        Ok(Response::new(pb::Sandbox {
            end_at_ms: end,
            ..sb(&r.sandbox_id, st)
        }))
    }
    async fn kill_sandbox(&self, r: Request<pb::SandboxRef>) -> R<pb::KillSandboxResponse> {
        self.0.kills.fetch_add(1, Ordering::SeqCst);
        let existed = self
            .0
            .sandboxes
            .lock()
            .unwrap()
            .remove(&r.into_inner().sandbox_id)
            .is_some();
        Ok(Response::new(pb::KillSandboxResponse { existed }))
    }
    async fn pause_sandbox(&self, r: Request<pb::PauseSandboxRequest>) -> R<pb::Sandbox> {
        self.0.pauses.fetch_add(1, Ordering::SeqCst);
        let r = r.into_inner();
        if r.filesystem_only {
            self.0.fs_pauses.fetch_add(1, Ordering::SeqCst);
        }
        let id = r.sandbox_id;
        let mut m = self.0.sandboxes.lock().unwrap();
        match m.get_mut(&id) {
            Some(s) => {
                *s = pb::SandboxState::Paused as i32;
                Ok(Response::new(sb(&id, *s)))
            }
            None => Err(Status::not_found("no such sandbox")),
        }
    }
    async fn resume_sandbox(&self, r: Request<pb::ResumeSandboxRequest>) -> R<pb::Sandbox> {
        let r = r.into_inner();
        if r.reboot {
            self.0.reboots.fetch_add(1, Ordering::SeqCst);
        }
        let id = r.sandbox_id;
        let mut m = self.0.sandboxes.lock().unwrap();
        match m.get_mut(&id) {
            Some(s) => {
                *s = pb::SandboxState::Running as i32;
                Ok(Response::new(sb(&id, *s)))
            }
            None => Err(Status::not_found("no such sandbox")),
        }
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
        let m = self.0.sandboxes.lock().unwrap();
        let created = self.0.created_ms.lock().unwrap();
        let ends = self.0.ends.lock().unwrap();
        Ok(Response::new(pb::ListSandboxesResponse {
            sandboxes: m
                .iter()
                .map(|(id, st)| pb::Sandbox {
                    created_at_ms: created.get(id).copied().unwrap_or(0),
                    end_at_ms: ends.get(id).copied().unwrap_or(0),
                    ..sb(id, *st)
                })
                .collect(),
        }))
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
    async fn node_status(&self, _r: Request<pb::NodeStatusRequest>) -> R<pb::NodeStatusResponse> {
        Ok(Response::new(pb::NodeStatusResponse {
            node_id: self.0.id.clone(),
            runtime: "namespace".into(),
            templates: self.0.templates.clone(),
            sandboxes: self.0.count() as u32,
            capacity: Some(pb::Capacity {
                max_sandboxes: self.0.max,
                ..Default::default()
            }),
            ..Default::default()
        }))
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
    async fn guest_health(&self, r: Request<pb::SandboxRef>) -> R<pb::GuestHealthResponse> {
        let id = r.into_inner().sandbox_id;
        self.0
            .state_of(&id)
            .ok_or_else(|| Status::not_found("no such sandbox"))?;
        let sick = self.0.unhealthy.lock().unwrap().contains(&id);
        Ok(Response::new(pb::GuestHealthResponse {
            healthy: !sick,
            detail: if sick {
                "agent timed out".into()
            } else {
                String::new()
            },
        }))
    }
    /// The node's answer names the sandbox, so a test sees which node was asked.
    async fn sandbox_metrics(
        &self,
        _r: Request<pb::SandboxMetricsRequest>,
    ) -> R<pb::SandboxMetricsResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn sandbox_logs(&self, r: Request<pb::SandboxLogsRequest>) -> R<pb::SandboxLogsResponse> {
        let r = r.into_inner();
        Ok(Response::new(pb::SandboxLogsResponse {
            entries: vec![pb::LogEntry {
                timestamp_ms: 1,
                level: "info".into(),
                message: format!("log of {}", r.sandbox_id),
                fields: Default::default(),
            }],
        }))
    }
    async fn set_end_time(&self, r: Request<pb::SetEndTimeRequest>) -> R<pb::Sandbox> {
        let r = r.into_inner();
        let st = self.0.state_of(&r.sandbox_id);
        let Some(st) = st else {
            return Err(Status::not_found("no such sandbox"));
        };
        self.0
            .ends
            .lock()
            .unwrap()
            .insert(r.sandbox_id.clone(), r.end_at_ms);
        Ok(Response::new(sb(&r.sandbox_id, st)))
    }
    async fn set_egress(&self, r: Request<pb::SetEgressRequest>) -> R<pb::Sandbox> {
        let r = r.into_inner();
        let st = self
            .0
            .state_of(&r.sandbox_id)
            .ok_or_else(|| Status::not_found("no such sandbox"))?;
        self.0.egress.lock().unwrap().insert(
            r.sandbox_id.clone(),
            (r.internet, r.allow_cidrs, r.deny_cidrs),
        );
        Ok(Response::new(sb(&r.sandbox_id, st)))
    }
}

/// Serves a fake node on a free port; returns its URL and a shutdown sender.
pub async fn serve(n: Arc<FakeNode>) -> (String, tokio::sync::oneshot::Sender<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let incoming = futures_util::stream::unfold(l, |l| async move {
        let r = l.accept().await.map(|(s, _)| s);
        Some((r, l))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(NodeServer::new(Handle(n)))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = rx.await;
            }),
    );
    (format!("http://{addr}"), tx)
}

/// A controller on the database at `url` with these static nodes, after one poll of them.
pub async fn controller(
    url: &str,
    statics: &[String],
    cfg: cube_master::MasterConfig,
) -> cube_master::ops::Controller {
    let db = cube_master::store::Db::open(url).await.unwrap();
    let nodes = cube_master::fleet::Nodes::new(statics, cfg.node_max_misses).unwrap();
    let ctl = cube_master::ops::Controller::new(
        cube_master::MasterConfig {
            nodes: statics.to_vec(),
            ..cfg
        },
        db,
        nodes,
    );
    ctl.load_nodes().await.unwrap();
    ctl.nodes.poll_once().await;
    ctl.check_nodes().await;
    ctl
}
