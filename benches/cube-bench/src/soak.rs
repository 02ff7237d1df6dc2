//! `cube-bench soak`: create / use / kill cycles at a chosen concurrency against any install.
//! With `--data-dir` (a `cubectl up` install, root) it can SIGKILL each daemon in turn on a
//! schedule and restart it with `cubectl up`, and it checks the node for leaks by comparing an
//! inventory (processes, network namespaces, host links, loop devices, mounts, cgroups, cube-vs
//! map entries, sandbox directories) taken before the cycles with one taken after them, once the
//! node has settled; the master is checked for rows left in a non-final state and for sandboxes
//! the node runs and the master does not know (orphans). Prints a table and writes JSON.

use crate::api::{Client, Sandbox};
use crate::target::{find_cubectl, TargetArgs};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const SCHEMA: &str = "cube-bench-soak/1";

/// The daemons of a `cubectl up` install, killed in this order (their pid file names).
const DAEMONS: [&str; 3] = ["cube-master", "cube-api", "cubelet"];

#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Create / use / kill cycles in all.
    #[arg(long, default_value_t = 1000)]
    pub cycles: usize,
    /// Clients running cycles at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// SIGKILL a daemon every N cycles (cube-master, cube-api, cubelet in turn) and restart it
    /// with `cubectl up`; 0 never. Needs --data-dir.
    #[arg(long, default_value_t = 0)]
    pub kill_every: usize,
    /// The `cubectl up` install (its data directory): what kills restart, and where the
    /// node's leak check looks. Without it only the API's view is checked.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// cubectl (default: next to cube-bench, then PATH).
    #[arg(long)]
    pub cubectl: Option<PathBuf>,
    /// Long-lived sandboxes made first; each must keep its file and answer at the end.
    #[arg(long, default_value_t = 2)]
    pub keep: usize,
    /// Most seconds to wait after the cycles for the node and master to settle (orphans
    /// reaped, pools refilled) before the leak check.
    #[arg(long, default_value_t = 180)]
    pub settle_s: u64,
    /// Seconds after a restarted daemon is ready during which failures count as in its kill
    /// window.
    #[arg(long, default_value_t = 5)]
    pub window_grace_s: u64,
    /// Most client operations that may fail, percent of all (and all inside kill windows).
    #[arg(long, default_value_t = 0.5)]
    pub max_failed_pct: f64,
    /// Where to write the JSON report (default: stdout only gets the table).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The parts of `<data-dir>/up.toml` (written by `cubectl up`) the soak needs.
#[derive(Debug, Clone, serde::Deserialize)]
struct Install {
    data_dir: PathBuf,
    run_dir: PathBuf,
    node_dir: PathBuf,
    cgroup_parent: String,
    ports: Ports,
    switch: Switch,
}

#[derive(Debug, Clone, serde::Deserialize)]
struct Ports {
    cubelet_metrics: u16,
}

#[derive(Debug, Clone, serde::Deserialize)]
struct Switch {
    pin_root: PathBuf,
}

impl Install {
    fn load(data_dir: &Path) -> Result<Install> {
        let p = data_dir.join("up.toml");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        toml::from_str(&text).with_context(|| format!("{} is not a cubectl up record", p.display()))
    }

    /// `cubectl` aimed at this install (not at a master named in the environment).
    fn cubectl(&self, cubectl: &Path) -> Command {
        let mut c = Command::new(cubectl);
        c.arg("--data-dir")
            .arg(&self.data_dir)
            .env_remove("CUBE_MASTER_URL")
            .env_remove("CUBE_DATA_DIR");
        c
    }

    fn pid(&self, daemon: &str) -> Option<u32> {
        std::fs::read_to_string(self.run_dir.join(format!("{daemon}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Kill {
    pub daemon: String,
    pub at_cycle: usize,
    /// Seconds since the soak began.
    pub killed_at_s: f64,
    pub ready_at_s: f64,
    pub restarted: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub op: &'static str,
    pub at_s: f64,
    pub in_kill_window: bool,
    pub error: String,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Leak {
    pub resource: String,
    pub before: u64,
    pub after: u64,
}

#[derive(Debug, Serialize)]
pub struct SoakReport {
    pub schema: &'static str,
    pub cycles: usize,
    pub concurrency: usize,
    pub seconds: f64,
    pub ops: BTreeMap<&'static str, u64>,
    pub failed: u64,
    pub failed_pct: f64,
    pub failed_outside_kill_windows: u64,
    pub failures: Vec<Failure>,
    pub kills: Vec<Kill>,
    pub keepers: usize,
    pub keepers_lost: Vec<String>,
    /// Node resources before and after (None without --data-dir).
    pub inventory: Option<Vec<Leak>>,
    pub leaked: Vec<Leak>,
    /// The master's rows of this run's sandboxes not in a final state after settling.
    pub non_final_rows: Option<u64>,
    /// Running sandboxes on the node minus running rows in the master, after settling.
    pub orphans: Option<i64>,
    pub problems: Vec<String>,
}

/// What a run shares between its clients.
struct Shared {
    /// This run's prefix of idempotency keys.
    run: String,
    t0: Instant,
    next: AtomicUsize,
    ops: Mutex<BTreeMap<&'static str, u64>>,
    failures: Mutex<Vec<(&'static str, f64, String)>>,
}

impl Shared {
    fn ok(&self, op: &'static str) {
        if let Ok(mut m) = self.ops.lock() {
            *m.entry(op).or_default() += 1;
        }
    }
    fn failed(&self, op: &'static str, e: impl std::fmt::Display) {
        self.ok(op);
        let at = self.t0.elapsed().as_secs_f64();
        if let Ok(mut v) = self.failures.lock() {
            v.push((op, at, e.to_string()));
        }
    }
}

/// `n` clients sharing one count of `cycles`.
fn start_clients(
    settings: &crate::api::Settings,
    run: String,
    n: usize,
    cycles: usize,
    template: &str,
) -> (Arc<Shared>, Vec<tokio::task::JoinHandle<()>>) {
    let s = Arc::new(Shared {
        run,
        t0: Instant::now(),
        next: AtomicUsize::new(0),
        ops: Mutex::default(),
        failures: Mutex::default(),
    });
    let tasks = (0..n)
        .map(|_| {
            tokio::spawn(client(
                Client::new(settings.clone()),
                s.clone(),
                cycles,
                template.to_string(),
            ))
        })
        .collect();
    (s, tasks)
}

/// One client: cycles until the run's count is reached.
async fn client(mut c: Client, s: Arc<Shared>, cycles: usize, template: String) {
    loop {
        let i = s.next.fetch_add(1, Ordering::SeqCst);
        if i >= cycles {
            return;
        }
        // A lost answer is resent under the same key (as a careful E2B client would), so a
        // create the server finished is claimed rather than left running. Each failed try
        // counts; a client that retried at once would count one outage many times.
        let key = format!("{}-{i}", s.run);
        let mut got = None;
        for _ in 0..20 {
            match c.create_keyed(&template, Some(&key)).await {
                Ok(sb) => {
                    s.ok("create");
                    got = Some(sb);
                    break;
                }
                Err(e) => {
                    s.failed("create", e);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
        let Some(sb) = got else { continue };
        let want = format!("soak-{i}");
        match c.run(&sb, &format!("echo {want}")).await {
            Ok(o) if o.stdout.trim() == want => s.ok("use"),
            Ok(o) => s.failed("use", format!("echo printed {:?}", o.stdout)),
            Err(e) => s.failed("use", e),
        }
        // A kill that fails leaves the sandbox to its timeout: retry it (bounded), so the leak
        // check sees what the server did, not what this client gave up on.
        let mut tries = 0;
        loop {
            match c.kill(&sb.id).await {
                Ok(()) => {
                    s.ok("kill");
                    break;
                }
                Err(e) => {
                    s.failed("kill", &e);
                    tries += 1;
                    if tries >= 20 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }
}

/// SIGKILLs `daemon` of the install and brings it back with `cubectl up`.
fn kill_and_restart(
    inst: &Install,
    cubectl: &Path,
    daemon: &str,
    t0: Instant,
    at_cycle: usize,
) -> Kill {
    let mut k = Kill {
        daemon: daemon.to_string(),
        at_cycle,
        killed_at_s: t0.elapsed().as_secs_f64(),
        ready_at_s: 0.0,
        restarted: false,
        detail: String::new(),
    };
    match inst.pid(daemon) {
        Some(pid) => {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            // Gone (or a zombie of whoever started it) before the restart looks for it.
            let end = Instant::now() + Duration::from_secs(10);
            while Instant::now() < end {
                let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                if st.is_empty()
                    || st
                        .rsplit(')')
                        .next()
                        .is_some_and(|r| r.trim_start().starts_with('Z'))
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        None => k.detail = format!("no pid file for {daemon}; "),
    }
    std::thread::sleep(Duration::from_secs(1));
    let out = inst.cubectl(cubectl).arg("up").output();
    k.ready_at_s = t0.elapsed().as_secs_f64();
    match out {
        Ok(o) if o.status.success() => k.restarted = true,
        Ok(o) => {
            k.detail += &format!(
                "cubectl up failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )
        }
        Err(e) => k.detail += &format!("running cubectl: {e}"),
    }
    k
}

fn count_dir(p: &Path) -> u64 {
    std::fs::read_dir(p).map(|r| r.count() as u64).unwrap_or(0)
}

fn cgroup_walk(dir: &Path, cgroups: &mut u64, procs: &mut u64) {
    *procs += std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().count() as u64)
        .unwrap_or(0);
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                *cgroups += 1;
                cgroup_walk(&e.path(), cgroups, procs);
            }
        }
    }
}

fn command_lines(cmd: &str, args: &[&str]) -> Vec<String> {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// What the node holds now, by resource, with its pool levels.
async fn inventory(inst: &Install) -> BTreeMap<String, u64> {
    let mut m = resources(inst);
    let text = metrics(&format!("127.0.0.1:{}", inst.ports.cubelet_metrics))
        .await
        .unwrap_or_default();
    for (name, pool) in [(NET_POOL, "network"), (STARTED_POOL, "started")] {
        let want = format!("cube_pool_ready{{pool=\"{pool}\"");
        let n: f64 = text
            .lines()
            .filter(|l| l.starts_with(&want))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum();
        m.insert(name.into(), n as u64);
    }
    m
}

fn resources(inst: &Install) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    let (mut cgroups, mut procs) = (0, 0);
    // cgroup v2, or its hierarchy under `unified` on a hybrid v1 host.
    if let Some(root) = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .map(|r| Path::new(r).join(&inst.cgroup_parent))
        .find(|p| p.is_dir())
    {
        cgroup_walk(&root, &mut cgroups, &mut procs);
    }
    m.insert("cgroups".into(), cgroups);
    m.insert("processes in sandbox cgroups".into(), procs);
    m.insert(
        "network namespaces".into(),
        count_dir(&inst.run_dir.join("netns")),
    );
    let links = command_lines("ip", &["-o", "link", "show"]);
    let named = |p: &str| {
        links
            .iter()
            .filter(|l| l.split(": ").nth(1).is_some_and(|n| n.starts_with(p)))
            .count() as u64
    };
    m.insert("veths (cvh*)".into(), named("cvh"));
    m.insert("taps (cbt*)".into(), named("cbt"));
    let under = |p: &str| {
        p.starts_with(inst.data_dir.to_str().unwrap_or("\0"))
            || p.starts_with(inst.run_dir.to_str().unwrap_or("\0"))
    };
    let loops = command_lines("losetup", &["-n", "-l", "-O", "BACK-FILE"]);
    m.insert(
        "loop devices".into(),
        loops.iter().filter(|l| under(l.trim())).count() as u64,
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    m.insert(
        "mounts".into(),
        mounts
            .lines()
            .filter(|l| l.split(' ').nth(4).is_some_and(under))
            .count() as u64,
    );
    if let Ok(rd) = std::fs::read_dir(inst.switch.pin_root.join("maps")) {
        for e in rd.flatten() {
            let out = Command::new("bpftool")
                .args(["-j", "map", "dump", "pinned"])
                .arg(e.path())
                .output();
            let n = out
                .ok()
                .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
                .and_then(|v| v.as_array().map(|a| a.len() as u64))
                .unwrap_or(0);
            m.insert(
                format!("{SWITCH_MAP}{}", e.file_name().to_string_lossy()),
                n,
            );
        }
    }
    m.insert(
        "sandbox directories".into(),
        count_dir(&inst.node_dir.join("sandboxes")),
    );
    m
}

/// Every pool of the node at its target (`cube_pool_ready` == `cube_pool_target`).
async fn pools_full(inst: &Install) -> bool {
    let url = format!("127.0.0.1:{}", inst.ports.cubelet_metrics);
    let Some(text) = metrics(&url).await else {
        return false;
    };
    let read = |name: &str| -> BTreeMap<String, f64> {
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k[name.len()..].to_string(), v.parse().ok()?))
            })
            .collect()
    };
    let (ready, target) = (read("cube_pool_ready"), read("cube_pool_target"));
    target
        .iter()
        .all(|(k, t)| ready.get(k).is_some_and(|r| r >= t))
}

/// `cube_sandboxes{state="running"}` of the node.
async fn node_running(inst: &Install) -> Option<i64> {
    let text = metrics(&format!("127.0.0.1:{}", inst.ports.cubelet_metrics)).await?;
    text.lines()
        .find_map(|l| l.strip_prefix("cube_sandboxes{state=\"running\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as i64)
}

async fn metrics(authority: &str) -> Option<String> {
    let ep = crate::http::Endpoint::parse(&format!("http://{authority}")).ok()?;
    let mut c = crate::http::Conn::new(ep, Duration::from_secs(5));
    let r = c.send("GET", "/metrics", &[], None).await.ok()?;
    (r.status == 200).then(|| String::from_utf8_lossy(&r.body).into_owned())
}

/// The master's rows by state, of sandboxes this tool made (`cube-bench=1`).
fn master_rows(inst: &Install, cubectl: &Path) -> Result<BTreeMap<String, u64>> {
    let mut cmd = inst.cubectl(cubectl);
    cmd.args(["--json", "sandbox", "list"]);
    for s in [
        "creating", "running", "pausing", "paused", "resuming", "killing",
    ] {
        cmd.args(["--state", s]);
    }
    let o = cmd
        .args(["--metadata", "cube-bench=1"])
        .output()
        .context("running cubectl sandbox list")?;
    if !o.status.success() {
        bail!(
            "cubectl sandbox list: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).context("cubectl sandbox list JSON")?;
    let mut m = BTreeMap::new();
    for s in v.as_array().into_iter().flatten() {
        *m.entry(s["state"].as_str().unwrap_or("?").to_string())
            .or_default() += 1;
    }
    Ok(m)
}

/// Pool levels in an inventory: a pooled endpoint or pre-started sandbox holds node resources
/// by design, and how many endpoints of killed sandboxes are kept for reuse varies with the
/// order of the last kills, so growth of a pool is not a leak.
const NET_POOL: &str = "pool: network endpoints";
const STARTED_POOL: &str = "pool: pre-started sandboxes";

/// Prefix of the inventory's cube-vs map sizes (one line per map).
const SWITCH_MAP: &str = "cube-vs map ";

/// What a pool entry of each kind holds of a resource (per entry).
fn pooled_share(resource: &str) -> (u64, u64) {
    match resource.strip_prefix(SWITCH_MAP) {
        // A switch port (every endpoint's veth) has one entry in each per-port map.
        Some("cvs_ports" | "cvs_stats" | "cvs_port_flows") => (1, 1),
        Some(_) => (0, 0),
        None => match resource {
            // (per network endpoint, per pre-started sandbox)
            "network namespaces" | "veths (cvh*)" | "mounts" => (1, 1),
            "sandbox directories" | "cgroups" => (0, 1),
            _ => (0, 0),
        },
    }
}

/// Resources that grew between two inventories beyond what their pools grew by.
pub fn leaks(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> Vec<Leak> {
    let grew = |k: &str| {
        after
            .get(k)
            .copied()
            .unwrap_or(0)
            .saturating_sub(before.get(k).copied().unwrap_or(0))
    };
    let (dn, ds) = (grew(NET_POOL), grew(STARTED_POOL));
    after
        .iter()
        .filter(|(k, _)| !k.starts_with("pool: "))
        .filter_map(|(k, a)| {
            let b = before.get(k).copied().unwrap_or(0);
            let (pn, ps) = pooled_share(k);
            (*a > b + dn * pn + ds * ps).then(|| Leak {
                resource: k.clone(),
                before: b,
                after: *a,
            })
        })
        .collect()
}

/// Whether a failure at `at` falls in a kill window (from the kill to `grace` after the
/// daemon was back).
pub fn in_window(kills: &[Kill], at: f64, grace: f64) -> bool {
    kills
        .iter()
        .any(|k| at >= k.killed_at_s && at <= k.ready_at_s + grace)
}

pub async fn main(a: SoakArgs) -> Result<()> {
    if a.cycles == 0 || a.concurrency == 0 {
        bail!("--cycles and --concurrency must be at least 1");
    }
    if a.kill_every > 0 && a.data_dir.is_none() {
        bail!("--kill-every needs --data-dir (the cubectl up install whose daemons it kills)");
    }
    let target = a.target.resolve()?;
    let settings = a.target.settings(&target)?;
    let inst = a.data_dir.as_deref().map(Install::load).transpose()?;
    let cubectl = match &inst {
        Some(_) => Some(
            find_cubectl(a.cubectl.as_deref())
                .context("--data-dir needs cubectl (next to cube-bench, on PATH, or --cubectl)")?,
        ),
        None => None,
    };
    let template = a.target.template.clone();
    let mut problems = Vec::new();

    // Warm up (the pools reach their recycled level), settle, then take the baseline.
    eprintln!("soak: warm-up ({} cycles)", a.concurrency * 2);
    let run = format!(
        "soak-{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    let (warm, tasks) = start_clients(
        &settings,
        format!("{run}-warm"),
        a.concurrency,
        a.concurrency * 2,
        &template,
    );
    for t in tasks {
        t.await.context("warm-up client")?;
    }
    if let Some(f) = warm.failures.lock().ok().and_then(|v| v.first().cloned()) {
        bail!("warm-up failed: {} at {:.1}s: {}", f.0, f.1, f.2);
    }
    let before = match &inst {
        Some(i) => {
            settle(i, Duration::from_secs(60), |_| true).await;
            Some(inventory(i).await)
        }
        None => None,
    };

    // Long-lived sandboxes that must come through every kill.
    eprintln!("soak: baseline taken; {} long-lived sandbox(es)", a.keep);
    let mut kc = Client::new(settings.clone());
    let mut keepers: Vec<Sandbox> = Vec::new();
    for k in 0..a.keep {
        let sb = kc
            .create(&template)
            .await
            .context("creating a long-lived sandbox")?;
        kc.run(&sb, &format!("echo kept-{k} > /tmp/soak-keep"))
            .await
            .context("writing a long-lived sandbox's file")?;
        keepers.push(sb);
    }

    eprintln!(
        "soak: {} cycles at concurrency {}{}",
        a.cycles,
        a.concurrency,
        if a.kill_every > 0 {
            format!(", a daemon SIGKILLed every {} cycles", a.kill_every)
        } else {
            String::new()
        }
    );
    let (s, tasks) = start_clients(&settings, run, a.concurrency, a.cycles, &template);
    let mut kills = Vec::new();
    if let (Some(i), Some(ctl), true) = (&inst, &cubectl, a.kill_every > 0) {
        let mut n = 0;
        loop {
            let mark = (n + 1) * a.kill_every;
            if mark >= a.cycles {
                break;
            }
            while s.next.load(Ordering::SeqCst) < mark && !tasks.iter().all(|t| t.is_finished()) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if tasks.iter().all(|t| t.is_finished()) {
                break;
            }
            let (i2, c2, d, t0) = (i.clone(), ctl.clone(), DAEMONS[n % DAEMONS.len()], s.t0);
            let k = tokio::task::spawn_blocking(move || kill_and_restart(&i2, &c2, d, t0, mark))
                .await
                .context("kill task")?;
            eprintln!(
                "soak: SIGKILL {} at cycle {mark}: back after {:.1}s{}",
                k.daemon,
                k.ready_at_s - k.killed_at_s,
                if k.restarted {
                    String::new()
                } else {
                    format!(" — NOT restarted: {}", k.detail)
                }
            );
            if !k.restarted {
                problems.push(format!("{} was not restarted: {}", k.daemon, k.detail));
            }
            kills.push(k);
            n += 1;
        }
    }
    for t in tasks {
        t.await.context("client")?;
    }
    let seconds = s.t0.elapsed().as_secs_f64();
    eprintln!("soak: cycles done in {seconds:.1} s; checking the long-lived sandboxes");

    let mut keepers_lost = Vec::new();
    for (k, sb) in keepers.iter().enumerate() {
        match kc.run(sb, "cat /tmp/soak-keep").await {
            Ok(o) if o.stdout.trim() == format!("kept-{k}") => {}
            Ok(o) => keepers_lost.push(format!("{}: file reads {:?}", sb.id, o.stdout)),
            Err(e) => keepers_lost.push(format!("{}: {e}", sb.id)),
        }
        if let Err(e) = kc.kill(&sb.id).await {
            problems.push(format!("killing long-lived {}: {e}", sb.id));
        }
    }

    eprintln!(
        "soak: settling (at most {} s), then the leak check",
        a.settle_s
    );
    // Settle: no row of ours left unfinished, no orphan, pools full and nothing above the
    // baseline, or the deadline.
    let (mut inventory_rows, mut leaked, mut non_final, mut orphans) =
        (None, Vec::new(), None, None);
    if let (Some(i), Some(ctl), Some(b)) = (&inst, &cubectl, &before) {
        let end = Instant::now() + Duration::from_secs(a.settle_s);
        loop {
            settle(i, Duration::from_secs(5), |_| true).await;
            let clean = leaks(b, &inventory(i).await).is_empty()
                && master_rows(i, ctl).is_ok_and(|m| m.values().sum::<u64>() == 0);
            if clean || Instant::now() >= end {
                break;
            }
        }
        let after = inventory(i).await;
        leaked = leaks(b, &after);
        inventory_rows = Some(
            b.iter()
                .map(|(k, v)| Leak {
                    resource: k.clone(),
                    before: *v,
                    after: after.get(k).copied().unwrap_or(0),
                })
                .collect(),
        );
        match master_rows(i, ctl) {
            Ok(m) => {
                non_final = Some(m.values().sum());
                // Every running sandbox on the node has a running row (ours are all gone, so
                // this is the whole node against the whole master).
                let all = running_rows(i, ctl);
                if let (Some(n), Ok(r)) = (node_running(i).await, all) {
                    orphans = Some(n - r as i64);
                }
            }
            Err(e) => problems.push(format!("{e:#}")),
        }
    }

    let ops = s.ops.lock().map(|m| m.clone()).unwrap_or_default();
    let total: u64 = ops.values().sum();
    let grace = a.window_grace_s as f64;
    let failures: Vec<Failure> = s
        .failures
        .lock()
        .map(|v| v.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|(op, at, error)| Failure {
            op,
            at_s: at,
            in_kill_window: in_window(&kills, at, grace),
            error,
        })
        .collect();
    let failed = failures.len() as u64;
    let outside = failures.iter().filter(|f| !f.in_kill_window).count() as u64;
    let failed_pct = if total > 0 {
        failed as f64 * 100.0 / total as f64
    } else {
        0.0
    };
    if failed_pct > a.max_failed_pct {
        problems.push(format!(
            "{failed_pct:.2}% of operations failed (most {}%)",
            a.max_failed_pct
        ));
    }
    if outside > 0 {
        problems.push(format!(
            "{outside} operation(s) failed outside any kill window"
        ));
    }
    if !keepers_lost.is_empty() {
        problems.push(format!(
            "{} long-lived sandbox(es) lost",
            keepers_lost.len()
        ));
    }
    if !leaked.is_empty() {
        problems.push(format!(
            "leaked: {}",
            leaked
                .iter()
                .map(|l| format!("{} {}→{}", l.resource, l.before, l.after))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if non_final.is_some_and(|n| n > 0) {
        problems.push(format!(
            "{} row(s) of this run not in a final state",
            non_final.unwrap_or(0)
        ));
    }
    if orphans.is_some_and(|o| o != 0) {
        problems.push(format!(
            "node and master disagree by {} running sandbox(es)",
            orphans.unwrap_or(0)
        ));
    }
    let report = SoakReport {
        schema: SCHEMA,
        cycles: a.cycles,
        concurrency: a.concurrency,
        seconds,
        ops,
        failed,
        failed_pct,
        failed_outside_kill_windows: outside,
        failures,
        kills,
        keepers: keepers.len(),
        keepers_lost,
        inventory: inventory_rows,
        leaked,
        non_final_rows: non_final,
        orphans,
        problems,
    };
    println!("{}", table(&report));
    if let Some(p) = &a.out {
        std::fs::write(p, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if !report.problems.is_empty() {
        bail!("soak failed: {}", report.problems.join("; "));
    }
    Ok(())
}

/// Every running row in the master (any team, any metadata).
fn running_rows(inst: &Install, cubectl: &Path) -> Result<u64> {
    let o = inst
        .cubectl(cubectl)
        .args(["--json", "sandbox", "list", "--state", "running"])
        .output()
        .context("running cubectl sandbox list")?;
    let v: serde_json::Value =
        serde_json::from_slice(&o.stdout).context("cubectl sandbox list JSON")?;
    Ok(v.as_array().map(|a| a.len() as u64).unwrap_or(0))
}

/// Waits until the node's pools are full and `done` holds, or `deadline` passes.
async fn settle(inst: &Install, deadline: Duration, done: impl Fn(&Install) -> bool) {
    let end = Instant::now() + deadline;
    loop {
        if pools_full(inst).await && done(inst) {
            // The switch and the refiller finish a moment after a pool reads full.
            tokio::time::sleep(Duration::from_millis(500)).await;
            return;
        }
        if Instant::now() >= end {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

pub fn table(r: &SoakReport) -> String {
    let mut o = format!(
        "soak: {} cycles at concurrency {} in {:.1} s ({:.1} cycles/s)\n\n| operation | count |\n|---|---:|\n",
        r.cycles,
        r.concurrency,
        r.seconds,
        r.cycles as f64 / r.seconds.max(0.001)
    );
    for (k, v) in &r.ops {
        o += &format!("| {k} | {v} |\n");
    }
    o += &format!(
        "\nfailed: {} ({:.3}%), {} outside kill windows\n",
        r.failed, r.failed_pct, r.failed_outside_kill_windows
    );
    if !r.kills.is_empty() {
        o += "\n| SIGKILL | at cycle | back after (s) | restarted |\n|---|---:|---:|---|\n";
        for k in &r.kills {
            o += &format!(
                "| {} | {} | {:.1} | {} |\n",
                k.daemon,
                k.at_cycle,
                k.ready_at_s - k.killed_at_s,
                if k.restarted { "yes" } else { "NO" }
            );
        }
    }
    if let Some(inv) = &r.inventory {
        o += "\n| node resource | before | after |\n|---|---:|---:|\n";
        for l in inv {
            o += &format!("| {} | {} | {} |\n", l.resource, l.before, l.after);
        }
    }
    o += &format!(
        "\nlong-lived sandboxes kept: {}/{}; master rows not final: {}; orphans: {}\n",
        r.keepers - r.keepers_lost.len(),
        r.keepers,
        r.non_final_rows.map_or("n/a".into(), |n| n.to_string()),
        r.orphans.map_or("n/a".into(), |n| n.to_string()),
    );
    for f in r.failures.iter().take(10) {
        o += &format!(
            "  {:.1}s {} {}: {}\n",
            f.at_s,
            f.op,
            if f.in_kill_window {
                "(kill window)"
            } else {
                "(OUTSIDE kill windows)"
            },
            f.error
        );
    }
    o += if r.problems.is_empty() {
        "\nverdict: PASS\n"
    } else {
        "\nverdict: FAIL\n"
    };
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaks_are_growth_only() {
        let b: BTreeMap<String, u64> = [("a".into(), 3), ("b".into(), 2)].into();
        let a: BTreeMap<String, u64> = [("a".into(), 3), ("b".into(), 1), ("c".into(), 1)].into();
        assert_eq!(
            leaks(&b, &a),
            vec![Leak {
                resource: "c".into(),
                before: 0,
                after: 1
            }]
        );
        let a: BTreeMap<String, u64> = [("a".into(), 4)].into();
        assert_eq!(leaks(&b, &a)[0].after, 4);
        // One more kept endpoint explains one more namespace, not two.
        let b: BTreeMap<String, u64> =
            [("network namespaces".into(), 4), (NET_POOL.into(), 2)].into();
        let a: BTreeMap<String, u64> =
            [("network namespaces".into(), 5), (NET_POOL.into(), 3)].into();
        assert!(leaks(&b, &a).is_empty());
        let a: BTreeMap<String, u64> =
            [("network namespaces".into(), 6), (NET_POOL.into(), 3)].into();
        assert_eq!(leaks(&b, &a).len(), 1);
    }

    #[test]
    fn kill_windows_cover_the_outage_and_a_grace() {
        let k = Kill {
            daemon: "cube-api".into(),
            at_cycle: 10,
            killed_at_s: 10.0,
            ready_at_s: 12.0,
            restarted: true,
            detail: String::new(),
        };
        let ks = [k];
        assert!(!in_window(&ks, 9.9, 5.0));
        assert!(in_window(&ks, 10.0, 5.0));
        assert!(in_window(&ks, 17.0, 5.0));
        assert!(!in_window(&ks, 17.1, 5.0));
        assert!(!in_window(&[], 11.0, 5.0));
    }
}
