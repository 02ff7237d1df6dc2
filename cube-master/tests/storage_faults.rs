//! The master's database failing under it (issue 21, storage faults): another writer holding
//! the SQLite file, and PostgreSQL restarted under create load. The master recovers by itself,
//! answers what it cannot do as `Unavailable` (clients retry; cube-api answers 503), and leaves
//! nothing half-done: no create that answered is lost, no row stays `creating`, and no sandbox
//! runs on a node without a live row.

mod common;

use common::{params, FakeNode, TestDb};
use cube_master::error::MasterError;
use cube_master::ops::Controller;
use cube_master::state::SandboxState;
use cube_master::store::SandboxRow;
use cube_master::MasterConfig;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

async fn master(url: &str, node: &Arc<FakeNode>) -> (Arc<Controller>, impl Drop) {
    let (addr, stop) = common::serve(node.clone()).await;
    let cfg = MasterConfig {
        reconcile_interval_ms: 1,
        ..Default::default()
    };
    let ctl = common::controller(url, &[addr], cfg).await;
    (Arc::new(ctl), Stop(Some(stop)))
}

struct Stop(Option<tokio::sync::oneshot::Sender<()>>);
impl Drop for Stop {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            let _ = s.send(());
        }
    }
}

/// `n` creates at once; their results in order.
async fn creates(ctl: &Arc<Controller>, n: usize) -> Vec<Result<SandboxRow, MasterError>> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let ctl = ctl.clone();
            tokio::spawn(async move { ctl.create(params()).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("create task"));
    }
    out
}

/// What a client may see while the database is away: an error it can retry (gRPC
/// `Unavailable`, a 503 from cube-api).
fn retryable(e: &MasterError) -> bool {
    e.is_transient_db() || matches!(e, MasterError::Unavailable(_))
}

/// Once the fault is over and the reaper and the node check have run: no row is `creating`,
/// every sandbox in `live` is `running` in the database and on the node, and the node runs
/// exactly the sandboxes whose rows are running.
async fn assert_consistent(ctl: &Controller, node: &FakeNode, live: &BTreeSet<String>) {
    ctl.reap_once().await.expect("reaper pass");
    ctl.check_nodes().await;
    let rows = ctl
        .db
        .list_in_states(&SandboxState::ALL)
        .await
        .expect("rows");
    let creating: Vec<_> = rows
        .iter()
        .filter(|r| r.state == SandboxState::Creating)
        .map(|r| r.id.clone())
        .collect();
    assert!(creating.is_empty(), "rows left creating: {creating:?}");
    for r in rows.iter().filter(|r| r.state == SandboxState::Failed) {
        assert!(!r.reason.is_empty(), "failed row {} without a reason", r.id);
    }
    let running: BTreeSet<String> = rows
        .iter()
        .filter(|r| r.state == SandboxState::Running)
        .map(|r| r.id.clone())
        .collect();
    let missing: Vec<_> = live.difference(&running).collect();
    assert!(
        missing.is_empty(),
        "created sandboxes lost their row: {missing:?}"
    );
    let on_node: BTreeSet<String> = node.sandboxes.lock().unwrap().keys().cloned().collect();
    assert_eq!(
        on_node, running,
        "the node runs exactly the sandboxes whose rows are running"
    );
}

/// Holds SQLite's write lock from another connection (another process would do the same) for
/// `hold`; returns once the lock is taken.
async fn hold_sqlite_write_lock(url: &str, hold: Duration) -> tokio::task::JoinHandle<()> {
    use sqlx::Connection;
    let mut c = sqlx::SqliteConnection::connect(url)
        .await
        .expect("second connection");
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut c)
        .await
        .expect("take the write lock");
    tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        sqlx::query("COMMIT").execute(&mut c).await.expect("commit");
        let _ = c.close().await;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_held_by_another_writer() {
    let node = Arc::new(FakeNode {
        id: "n1".into(),
        templates: vec!["base".into()],
        max: 1000,
        create_delay_ms: 300,
        ..Default::default()
    });
    let db = TestDb::sqlite();
    let (ctl, _stop) = master(&db.url, &node).await;
    let mut live = BTreeSet::new();

    // Held for less than the busy wait (5 s): creates wait for the lock and succeed.
    let holder = hold_sqlite_write_lock(&db.url, Duration::from_millis(1500)).await;
    let started = Instant::now();
    for r in creates(&ctl, 4).await {
        let row = r.expect("a create waits out a short lock");
        assert_eq!(row.state, SandboxState::Running);
        live.insert(row.id);
    }
    assert!(started.elapsed() >= Duration::from_millis(1200));
    holder.await.unwrap();

    // Held past the busy wait, taken while creates are at the node: recording their sandboxes
    // fails, and so does marking them failed. They answer Unavailable, their sandboxes go from
    // the node, and the reaper fails their rows once the database is back.
    let before = node.creates.load(std::sync::atomic::Ordering::SeqCst);
    let inflight = {
        let ctl = ctl.clone();
        tokio::spawn(async move { creates(&ctl, 4).await })
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    let holder = hold_sqlite_write_lock(&db.url, Duration::from_millis(11_000)).await;
    // Creates that start under the lock cannot insert their rows: Unavailable, nothing made.
    for r in creates(&ctl, 2).await {
        let e = r.expect_err("no create can be recorded while another writer holds the file");
        assert!(retryable(&e), "not a retryable error: {e}");
        assert!(e.to_string().contains("database"), "{e}");
    }
    let mut unrecorded = Vec::new();
    for r in inflight.await.unwrap() {
        match r {
            Ok(row) => {
                live.insert(row.id);
            }
            Err(e) => {
                assert!(retryable(&e), "not a retryable error: {e}");
                unrecorded.push(e);
            }
        }
    }
    assert!(
        !unrecorded.is_empty(),
        "the lock was taken after the creates reached the node: their recording must fail"
    );
    assert_eq!(
        node.creates.load(std::sync::atomic::Ordering::SeqCst) - before,
        4,
        "only the creates begun before the lock reached the node"
    );
    // Their sandboxes did not stay on the node.
    assert_eq!(node.count(), live.len());
    holder.await.unwrap();

    // Back: the master works without a restart, and nothing is half-done.
    for r in creates(&ctl, 2).await {
        live.insert(r.expect("creates work again once the lock is gone").id);
    }
    assert_consistent(&ctl, &node, &live).await;
    let failed = ctl
        .db
        .list_in_states(&[SandboxState::Failed])
        .await
        .unwrap();
    assert!(
        failed
            .iter()
            .any(|r| r.reason.contains("could not be recorded")),
        "the reaper failed the rows whose create could not record its end: {:?}",
        failed.iter().map(|r| &r.reason).collect::<Vec<_>>()
    );
}

/// A PostgreSQL cluster of the test's own (initdb in a temporary directory, its own port), so
/// that restarting it disturbs no other test.
struct PrivatePg {
    _dir: tempfile::TempDir,
    data: PathBuf,
    log: PathBuf,
    bin: PathBuf,
    port: u16,
}

impl PrivatePg {
    fn bin_dir() -> Result<PathBuf, String> {
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .map_err(|e| format!("/usr/lib/postgresql: {e} (apt-get install postgresql)"))?
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("bin"))
            .filter(|b| b.join("initdb").exists())
            .collect();
        found.sort();
        found
            .pop()
            .ok_or_else(|| "no initdb under /usr/lib/postgresql/*/bin".to_string())
    }

    fn start(bin: PathBuf) -> PrivatePg {
        let dir = tempfile::tempdir().expect("tempdir");
        let st = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(dir.path())
            .status()
            .expect("chown");
        assert!(st.success(), "chown the cluster directory to postgres");
        let data = dir.path().join("data");
        let log = dir.path().join("log");
        let pg = PrivatePg {
            port: cube_testkit::reserve_port(),
            data,
            log,
            bin,
            _dir: dir,
        };
        pg.run(
            "initdb",
            &[
                "-D",
                &pg.data.display().to_string(),
                "-A",
                "trust",
                "-U",
                "cube",
                "--no-sync",
            ],
        );
        pg.pg_ctl(&["start"]);
        pg
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join(tool))
            .args(args)
            .output()
            .expect("runuser");
        assert!(
            out.status.success(),
            "{tool} {args:?}: {}{}\nlog: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// `pg_ctl <action>` on this cluster, waiting for it to finish.
    fn pg_ctl(&self, action: &[&str]) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.data.parent().unwrap_or(Path::new("/tmp")).display()
        );
        let (data, log) = (
            self.data.display().to_string(),
            self.log.display().to_string(),
        );
        let mut args = vec!["-D", &data, "-l", &log, "-w", "-t", "60", "-o", &opts];
        args.extend_from_slice(action);
        self.run("pg_ctl", &args);
    }

    fn url(&self) -> String {
        format!("postgres://cube@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .args([
                "-D",
                &self.data.display().to_string(),
                "-m",
                "immediate",
                "stop",
            ])
            .output();
    }
}

/// One operation of the load, as the client saw it.
struct Op {
    at: Instant,
    result: Result<SandboxRow, String>,
    retryable: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restarted_under_load() {
    let name = "storage_faults::postgres_restarted_under_load";
    let Some(_gate) = cube_testkit::require(name, &[cube_testkit::Need::Priv]) else {
        return;
    };
    let bin = match PrivatePg::bin_dir() {
        Ok(b) => b,
        Err(why) => panic!("{name}: PostgreSQL's programs are needed: {why}"),
    };
    let pg = tokio::task::spawn_blocking(move || PrivatePg::start(bin))
        .await
        .unwrap();
    let node = Arc::new(FakeNode {
        id: "n1".into(),
        templates: vec!["base".into()],
        max: 100_000,
        create_delay_ms: 50,
        ..Default::default()
    });
    let (ctl, _stop) = master(&pg.url(), &node).await;

    // Four clients create (and kill every other sandbox) until told to stop.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ops = Arc::new(std::sync::Mutex::new(Vec::<Op>::new()));
    let killed = Arc::new(std::sync::Mutex::new(BTreeSet::<String>::new()));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (ctl, stop, ops, killed) = (ctl.clone(), stop.clone(), ops.clone(), killed.clone());
            tokio::spawn(async move {
                let mut i = 0u32;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let r = ctl.create(params()).await;
                    let op = Op {
                        at: Instant::now(),
                        retryable: r.as_ref().err().is_some_and(retryable),
                        result: r.map_err(|e| e.to_string()),
                    };
                    if let Ok(row) = &op.result {
                        i += 1;
                        if i.is_multiple_of(2) && ctl.kill("t", &row.id, "test").await.is_ok() {
                            killed.lock().unwrap().insert(row.id.clone());
                        }
                    }
                    ops.lock().unwrap().push(op);
                }
            })
        })
        .collect();

    // A restart (PostgreSQL's fast shutdown ends every connection), then an outage longer
    // than the pool's wait for a connection (10 s), so that some creates must fail.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let restart = Instant::now();
    let pg = tokio::task::spawn_blocking(move || {
        pg.pg_ctl(&["-m", "fast", "restart"]);
        pg
    })
    .await
    .unwrap();
    let restarted = Instant::now();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let down = Instant::now();
    let pg = tokio::task::spawn_blocking(move || {
        pg.pg_ctl(&["-m", "fast", "stop"]);
        std::thread::sleep(Duration::from_secs(12));
        pg.pg_ctl(&["start"]);
        pg
    })
    .await
    .unwrap();
    let up = Instant::now();
    tokio::time::sleep(Duration::from_millis(5000)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }

    let ops = std::mem::take(&mut *ops.lock().unwrap());
    let ok_before = ops
        .iter()
        .filter(|o| o.at < restart && o.result.is_ok())
        .count();
    assert!(ok_before > 0, "creates worked before the restart");
    // The restart is ridden out: the pool replaces the connections it ended.
    let across_restart: Vec<&Op> = ops
        .iter()
        .filter(|o| o.at >= restart && o.at < down)
        .collect();
    assert!(
        across_restart
            .iter()
            .any(|o| o.at > restarted && o.result.is_ok()),
        "creates work after the restart without restarting the master"
    );
    let restart_failures = across_restart.iter().filter(|o| o.result.is_err()).count();
    let first_ok_after = ops
        .iter()
        .filter(|o| o.at > up && o.result.is_ok())
        .map(|o| o.at - up)
        .min()
        .expect("creates work again after the restart, without restarting the master");
    assert!(
        first_ok_after < Duration::from_secs(5),
        "first create after the restart took {first_ok_after:?}"
    );
    let failures: Vec<&Op> = ops.iter().filter(|o| o.result.is_err()).collect();
    assert!(
        failures.iter().any(|f| f.at > down),
        "an outage past the pool's wait fails creates (Unavailable) rather than hanging them"
    );
    for f in &failures {
        assert!(
            f.retryable,
            "a create failed with an error clients do not retry: {:?}",
            f.result.as_ref().err()
        );
        assert!(
            (f.at >= restart && f.at <= restarted + Duration::from_secs(2))
                || (f.at >= down && f.at <= up + Duration::from_secs(5)),
            "a create failed outside the restart window: {:?}",
            f.result.as_ref().err()
        );
    }
    let created: BTreeSet<String> = ops
        .iter()
        .filter_map(|o| o.result.as_ref().ok().map(|r| r.id.clone()))
        .collect();
    let killed = killed.lock().unwrap().clone();
    let live: BTreeSet<String> = created.difference(&killed).cloned().collect();
    assert_consistent(&ctl, &node, &live).await;
    // The killed ones stay killed: their rows are there, none came back.
    let rows = ctl
        .db
        .list_in_states(&[SandboxState::Killed])
        .await
        .unwrap();
    let killed_rows: BTreeSet<String> = rows.into_iter().map(|r| r.id).collect();
    assert!(
        killed.is_subset(&killed_rows),
        "a killed sandbox lost its row"
    );
    println!(
        "postgres under load: {} creates ok; fast restart took {:?} and failed {} creates; a {:?} outage failed {} (all retryable, all inside the outage or 5 s after); first create after it {:?}",
        created.len(),
        restarted - restart,
        restart_failures,
        up - down,
        failures.len() - restart_failures,
        first_ok_after
    );
    drop(pg);
}
