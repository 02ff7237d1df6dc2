//! `cube-bench`: the benchmark a user runs against a running Cube (the `E2B_API_URL`,
//! `E2B_SANDBOX_URL` and `E2B_API_KEY` that `cubectl up` prints). It writes `cube-bench.json`,
//! `cube-bench.md` and PNG plots into `--out DIR`. `cube-bench vmm` runs the component
//! micro-benchmarks from the same entry point. See benches/README.md.

mod api;
mod http;
mod machine;
mod micro;
mod plot;
mod report;
mod runtimes;
mod soak;
mod stats;
mod suite;
mod target;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use report::{Environment, Report, SCHEMA};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use target::{find_cubectl, Target, TargetArgs};

#[derive(Parser, Debug)]
#[command(
    name = "cube-bench",
    version,
    about = "Benchmarks a running Cube (E2B API) and writes JSON, markdown and PNG plots",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the component micro-benchmarks (vmm-bench, shim-bench, agent-bench; vs-bench and node-bench with --only).
    #[command(alias = "micro")]
    Vmm(MicroArgs),
    /// Redraw the plots and markdown of a finished run from its cube-bench.json.
    Plot(PlotArgs),
    /// Create / use / kill cycles at a chosen concurrency, optionally SIGKILLing each daemon of
    /// a `cubectl up` install on a schedule, then a check for leaks on the node and the master.
    Soak(soak::SoakArgs),
}

#[derive(clap::Args, Debug)]
struct PlotArgs {
    /// Directory holding cube-bench.json (plots and cube-bench.md are written there).
    dir: PathBuf,
    /// TrueType font for the plot labels.
    #[arg(long)]
    font: Option<PathBuf>,
}

fn plot_main(a: PlotArgs) -> Result<()> {
    let path = a.dir.join("cube-bench.json");
    let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let r: Report = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not a cube-bench report", path.display()))?;
    if r.schema != SCHEMA {
        bail!(
            "{}: schema {:?}, this cube-bench reads {SCHEMA:?}",
            path.display(),
            r.schema
        );
    }
    std::fs::write(a.dir.join("cube-bench.md"), report::markdown(&r))?;
    plot::load_font(a.font.as_deref()).map_err(anyhow::Error::msg)?;
    let (pngs, notes) = plot::write_all(&r, &a.dir);
    for n in notes {
        eprintln!("plot note: {n}");
    }
    eprintln!(
        "wrote cube-bench.md and {} plot(s) in {}",
        pngs.len(),
        a.dir.display()
    );
    Ok(())
}

#[derive(clap::Args, Debug)]
struct MicroArgs {
    /// Output directory (default benches/results/<date>-<host>-micro/).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Comma-separated benches: vmm-bench, shim-bench, agent-bench, vs-bench, node-bench.
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Directory with the bench binaries (default: next to cube-bench, then PATH).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// The cube-agent binary for agent-bench (default $CUBE_AGENT_BIN, then next to cube-bench).
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    /// Fewer iterations.
    #[arg(long)]
    quick: bool,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Output directory (default benches/results/<date>-<host>/).
    #[arg(long)]
    out: Option<PathBuf>,
    /// About one minute: concurrency 1,5,10, few samples, density up to --density-max (default 20).
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    target: TargetArgs,
    /// Concurrency levels (default 1,5,10,20,50; --quick 1,5,10).
    #[arg(long, value_delimiter = ',')]
    concurrency: Option<Vec<usize>>,
    /// Measured samples per concurrency level, at least 4 (--quick 2) × concurrency (default 100; --quick 10).
    #[arg(long)]
    samples: Option<usize>,
    /// Warm-up rounds (× concurrency creates, discarded) before each measured phase (default 2; --quick 1).
    #[arg(long)]
    warmup_rounds: Option<usize>,
    /// Most sandboxes kept alive by the create-only throughput phase.
    #[arg(long, default_value_t = 200)]
    max_live: usize,
    /// Largest density step (steps are 100, 300, 500, 1000 up to this; default 1000, --quick 20).
    #[arg(long)]
    density_max: Option<usize>,
    /// Skip the density measurement.
    #[arg(long)]
    no_density: bool,
    /// Treat the API as running on this host even if its URL is not loopback (enables density).
    #[arg(long)]
    assume_local: bool,
    /// Seconds to let memory settle before each density reading (default 5; --quick 1).
    #[arg(long)]
    settle_s: Option<f64>,
    /// Dirty memory sizes for pause/resume and snapshot/clone, MiB (default 0,16,64,256; --quick 0,8).
    #[arg(long, value_delimiter = ',')]
    dirty_mib: Option<Vec<u64>>,
    /// Repetitions per dirty size (default 3; --quick 1).
    #[arg(long)]
    reps: Option<usize>,
    /// TrueType font for the plots (default: DejaVu Sans or any .ttf under /usr/share/fonts).
    #[arg(long)]
    font: Option<PathBuf>,
    /// cubectl binary used to record node runtime and versions, and with --runtime to start
    /// the stacks (default: next to cube-bench, then PATH).
    #[arg(long)]
    cubectl: Option<PathBuf>,
    /// Measure each of these runtimes (namespace, gvisor, microvm) on a throwaway single-host
    /// Cube of its own (`cubectl up` in a data directory under --out; root), one after the
    /// other, and write them side by side (runtimes.md, runtimes.json). E2B_* are not used then.
    #[arg(long, value_delimiter = ',')]
    runtime: Vec<String>,
    /// With --runtime: build each stack's `base` from this root filesystem directory
    /// (`cubectl up --base-dir`) instead of Debian bookworm.
    #[arg(long)]
    base_dir: Option<PathBuf>,
    /// With --runtime: the cube-agent put into templates (`cubectl up --agent`).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// With --runtime: sandboxes of `base` each stack keeps started (`cubectl up --pool`).
    #[arg(long, default_value_t = 8)]
    pool: u32,
    /// With --runtime: size of each stack's sparse XFS image, GiB (`cubectl up --xfs-size-gib`).
    #[arg(long, default_value_t = 16)]
    xfs_size_gib: u32,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `YYYYMMDD-HHMMSS` (UTC) for directory names.
fn stamp(unix: u64) -> String {
    let t = i64::try_from(unix)
        .ok()
        .and_then(|u| time::OffsetDateTime::from_unix_timestamp(u).ok())
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let format = time::macros::format_description!("[year][month][day]-[hour][minute][second]");
    t.format(&format).unwrap_or_default()
}

fn results_root() -> PathBuf {
    // In a checkout, results go to the repository's benches/results (git-ignored).
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results");
    if repo.is_dir() {
        repo
    } else {
        PathBuf::from("benches/results")
    }
}

fn default_out(suffix: &str) -> PathBuf {
    let host = machine::detect().hostname.replace(['/', ' '], "_");
    results_root().join(format!("{}-{host}{suffix}", stamp(unix_now())))
}

/// Density steps: CubeSandbox's 100/300/500/1000 up to `max`, and `max` itself.
fn density_levels(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [100, 300, 500, 1000]
        .into_iter()
        .filter(|l| *l <= max)
        .collect();
    if max > 0 && !v.contains(&max) {
        v.push(max);
    }
    v
}

/// Runs a command with a deadline; its stdout when it succeeded.
fn run_with_deadline(mut cmd: Command, deadline: Duration) -> Option<String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) => {
                let mut out = String::new();
                use std::io::Read;
                child.stdout.take()?.read_to_string(&mut out).ok()?;
                return st.success().then_some(out);
            }
            Ok(None) if t0.elapsed() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// The cubectl binary: `explicit`, else next to cube-bench, else on PATH.
fn cubectl_nodes(explicit: Option<&Path>, master: Option<&str>) -> Option<Value> {
    let mut cmd = Command::new(find_cubectl(explicit)?);
    if let Some(m) = master {
        cmd.args(["--master", m]);
    }
    cmd.args(["--json", "nodes"]);
    let out = run_with_deadline(cmd, Duration::from_secs(10))?;
    serde_json::from_str(&out).ok()
}

fn git_rev() -> Option<String> {
    let mut cmd = Command::new("git");
    cmd.args([
        "-C",
        env!("CARGO_MANIFEST_DIR"),
        "rev-parse",
        "--short",
        "HEAD",
    ]);
    run_with_deadline(cmd, Duration::from_secs(5))
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn micro_main(a: MicroArgs) -> Result<()> {
    let out = a.out.unwrap_or_else(|| default_out("-micro"));
    let only: Vec<String> = a
        .only
        .unwrap_or_else(|| micro::DEFAULT.iter().map(|s| s.to_string()).collect());
    for o in &only {
        if !micro::ALL.iter().any(|b| b.name == o) {
            bail!("unknown micro-benchmark {o:?}: choose from vmm-bench, shim-bench, agent-bench, vs-bench, node-bench");
        }
    }
    let ok = micro::run(
        &out,
        &only,
        a.bin_dir.as_deref(),
        a.quick,
        a.agent_bin.as_deref(),
    )?;
    if !ok {
        bail!(
            "some micro-benchmarks failed or were missing; see {}/micro.md",
            out.display()
        );
    }
    Ok(())
}

fn plan(a: &RunArgs, api_local: bool, api_url: &str) -> Result<suite::Plan> {
    let q = a.quick;
    let concurrency = a.concurrency.clone().unwrap_or_else(|| {
        if q {
            vec![1, 5, 10]
        } else {
            vec![1, 5, 10, 20, 50]
        }
    });
    if concurrency.is_empty() || concurrency.iter().any(|c| *c == 0 || *c > 1000) {
        bail!("--concurrency: give levels between 1 and 1000");
    }
    let reps = a.reps.unwrap_or(if q { 1 } else { 3 });
    if reps == 0 {
        bail!("--reps must be at least 1");
    }
    let density_max = a.density_max.unwrap_or(if q { 20 } else { 1000 });
    let density_skip_reason = if a.no_density || density_max == 0 {
        Some("skipped (--no-density or --density-max 0)".to_string())
    } else if !(api_local || a.assume_local) {
        Some(format!("skipped: the API at {api_url} is not on this host (loopback), so this host's MemAvailable would not see the sandboxes; run cube-bench on the node, or pass --assume-local if the URL is this host"))
    } else {
        None
    };
    let settle = a.settle_s.unwrap_or(if q { 1.0 } else { 5.0 });
    if !(0.0..=600.0).contains(&settle) {
        bail!("--settle-s must be between 0 and 600");
    }
    let dirty_mib =
        a.dirty_mib
            .clone()
            .unwrap_or_else(|| if q { vec![0, 8] } else { vec![0, 16, 64, 256] });
    if dirty_mib.iter().any(|d| *d > 64 * 1024) {
        bail!("--dirty-mib: at most 65536 MiB");
    }
    Ok(suite::Plan {
        concurrency,
        samples: a.samples.unwrap_or(if q { 10 } else { 100 }).max(1),
        min_rounds: if q { 2 } else { 4 },
        warmup_rounds: a.warmup_rounds.unwrap_or(if q { 1 } else { 2 }),
        max_live: a.max_live.max(1),
        density_levels: density_levels(density_max),
        density_skip_reason,
        settle: Duration::from_secs_f64(settle),
        dirty_mib,
        lifecycle_reps: reps,
    })
}

async fn run_main(a: RunArgs) -> Result<()> {
    let out = a.out.clone().unwrap_or_else(|| default_out(""));
    if !a.runtime.is_empty() {
        return run_runtimes(&a, out).await;
    }
    let target = a.target.resolve()?;
    run_suite(&a, &target, &out).await.map(|_| ())
}

/// `--runtime`: every runtime on a stack of its own, then the comparison. Fails when any
/// runtime could not be measured (after writing what was).
async fn run_runtimes(a: &RunArgs, out: PathBuf) -> Result<()> {
    runtimes::validate(&a.runtime)?;
    let cubectl = find_cubectl(a.cubectl.as_deref())
        .context("--runtime needs cubectl (next to cube-bench, on PATH, or --cubectl)")?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let opts = runtimes::StackOpts {
        cubectl,
        dir: out.join("stacks"),
        base_dir: a.base_dir.clone(),
        agent: a.agent.clone(),
        pool: a.pool,
        xfs_size_gib: a.xfs_size_gib,
    };
    let started_unix = unix_now();
    let mut rows = Vec::new();
    for rt in &a.runtime {
        let dir = out.join(rt);
        let stack = {
            let o = opts.clone();
            let rt = rt.clone();
            tokio::task::spawn_blocking(move || runtimes::Stack::up(&o, &rt))
                .await
                .context("cubectl up task")?
        };
        let row = match stack {
            Ok(stack) => {
                let t = Target {
                    api_url: stack.api_url.clone(),
                    sandbox_url: stack.sandbox_url.clone(),
                    api_key: stack.api_key.clone(),
                    master_url: Some(stack.master_url.clone()),
                };
                let r = run_suite(a, &t, &dir).await;
                tokio::task::spawn_blocking(move || drop(stack))
                    .await
                    .context("cubectl down task")?;
                match r {
                    Ok(rep) => runtimes::Compared::of(&rep, &dir),
                    Err(e) => runtimes::Compared::failed(rt, &dir, format!("{e:#}")),
                }
            }
            Err(e) => runtimes::Compared::failed(rt, &dir, format!("{e:#}")),
        };
        if let Some(e) = &row.error {
            eprintln!("== {rt}: not measured: {e}");
        }
        rows.push(row);
    }
    let _ = std::fs::remove_dir(&opts.dir);
    let machine = machine::detect();
    let md = runtimes::markdown(&rows, &machine);
    std::fs::write(out.join("runtimes.md"), &md)?;
    let json = runtimes::Comparison {
        schema: runtimes::SCHEMA,
        started_unix,
        machine: &machine,
        runtimes: &rows,
    };
    std::fs::write(out.join("runtimes.json"), serde_json::to_vec_pretty(&json)?)?;
    println!("{md}");
    eprintln!("wrote {}/runtimes.json and runtimes.md", out.display());
    let failed: Vec<&str> = rows
        .iter()
        .filter(|r| r.error.is_some())
        .map(|r| r.runtime.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("not measured: {} (see runtimes.md)", failed.join(", "));
    }
    Ok(())
}

/// The whole suite against one Cube; the report is also written under `out`.
async fn run_suite(a: &RunArgs, t: &Target, out: &Path) -> Result<Report> {
    let started = Instant::now();
    let started_unix = unix_now();
    let (api_url, sandbox_url) = (t.api_url.clone(), t.sandbox_url.clone());
    let settings = a.target.settings(t)?;
    let api_local = settings.api.is_loopback();
    let plan = plan(a, api_local, &api_url)?;
    let font = match plot::load_font(a.font.as_deref()) {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("warning: plots will be skipped: {e}");
            None
        }
    };

    // Preflight: one sandbox end to end, which also tells us the runtime and the envd version.
    let machine = machine::detect();
    eprintln!(
        "cube-bench {} on {}",
        env!("CARGO_PKG_VERSION"),
        machine.short()
    );
    eprintln!(
        "API {api_url}, edge {sandbox_url}, template {:?}",
        a.target.template
    );
    let mut c = api::Client::new(settings.clone());
    let sb = c.create(&a.target.template).await.with_context(|| {
        format!(
            "preflight: cannot create a sandbox of template {:?} at {api_url}",
            a.target.template
        )
    })?;
    let pre = async {
        let d = c.detail(&sb.id).await?;
        let o = c.run(&sb, "echo hi").await?;
        Ok::<_, api::ApiError>((d, o))
    }
    .await;
    let _ = c.kill(&sb.id).await;
    let (detail, echo) = pre.with_context(|| {
        format!(
            "preflight: sandbox {} created but not usable through {sandbox_url}",
            sb.id
        )
    })?;
    if echo.stdout != "hi\n" {
        bail!("preflight: `echo hi` printed {:?}", echo.stdout);
    }
    let nodes = tokio::task::spawn_blocking({
        let (p, m) = (a.cubectl.clone(), t.master_url.clone());
        move || cubectl_nodes(p.as_deref(), m.as_deref())
    })
    .await
    .ok()
    .flatten();
    let node_field = |k: &str| -> Vec<String> {
        let mut v: Vec<String> = nodes
            .as_ref()
            .and_then(|n| n.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|n| n[k].as_str().filter(|s| !s.is_empty()).map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v.dedup();
        v
    };
    let (runtime, runtime_source) = match detail["runtime"].as_str().filter(|s| !s.is_empty()) {
        Some(r) => (
            r.to_string(),
            "sandbox detail (GET /sandboxes/{id})".to_string(),
        ),
        None => match node_field("runtime") {
            v if !v.is_empty() => (v.join("+"), "cubectl nodes".to_string()),
            _ => (
                "unknown".to_string(),
                "not in the sandbox detail; cubectl nodes unavailable".to_string(),
            ),
        },
    };
    let mut versions = BTreeMap::from([(
        "cube-bench".to_string(),
        env!("CARGO_PKG_VERSION").to_string(),
    )]);
    if let Some(g) = git_rev() {
        versions.insert("git".into(), g);
    }
    if !sb.envd_version.is_empty() {
        versions.insert("envd".into(), sb.envd_version.clone());
    }
    if let v @ [_, ..] = node_field("version").as_slice() {
        versions.insert("node".into(), v.join("+"));
    }
    let environment = Environment {
        machine: machine.clone(),
        runtime,
        runtime_source,
        isolation: detail["isolation"].as_str().unwrap_or_default().to_string(),
        versions,
        api_url: api_url.clone(),
        sandbox_url: sandbox_url.clone(),
        template: a.target.template.clone(),
        api_local,
        nodes,
    };
    eprintln!(
        "runtime {} ({})",
        environment.runtime, environment.runtime_source
    );
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;

    // The report is rewritten after every phase, so an interrupted run keeps what it measured.
    let mut report = Report {
        schema: SCHEMA.into(),
        started_unix,
        duration_s: 0.0,
        quick: a.quick,
        environment,
        create_latency: report::Section::pending(suite::CLOCK_CREATE),
        create_to_first_command: report::Section::pending(suite::CLOCK_FIRST_CMD),
        throughput: report::Section::pending(suite::CLOCK_THROUGHPUT),
        density: report::Section::pending(suite::CLOCK_DENSITY),
        pause_resume: report::Section::pending(suite::CLOCK_PAUSE),
        snapshot_clone: report::Section::pending(suite::CLOCK_SNAPSHOT),
    };
    let save = |r: &mut Report| -> Result<()> {
        r.duration_s = started.elapsed().as_secs_f64();
        let path = out.join("cube-bench.json");
        std::fs::write(&path, serde_json::to_vec_pretty(r)?)
            .with_context(|| format!("writing {}", path.display()))
    };
    save(&mut report)?;
    let lt = suite::latency_and_throughput(&settings, &plan).await;
    report.create_latency = lt.create_latency;
    report.create_to_first_command = lt.first_command;
    report.throughput = lt.throughput;
    save(&mut report)?;
    report.density = suite::density(&settings, &plan).await;
    save(&mut report)?;
    let (pause_resume, snapshot_clone) = suite::lifecycle(&settings, &plan).await;
    report.pause_resume = pause_resume;
    report.snapshot_clone = snapshot_clone;
    save(&mut report)?;
    let md = report::markdown(&report);
    std::fs::write(out.join("cube-bench.md"), &md)?;
    let (pngs, notes) = if font.is_some() {
        plot::write_all(&report, out)
    } else {
        (Vec::new(), vec!["plots skipped: no font".to_string()])
    };
    println!("{md}");
    eprintln!("\n== summary ==");
    for line in summary(&report) {
        eprintln!("{line}");
    }
    for n in notes {
        eprintln!("plot note: {n}");
    }
    eprintln!(
        "wrote {}/cube-bench.json, cube-bench.md and {} plot(s) in {:.0} s",
        out.display(),
        pngs.len(),
        report.duration_s
    );
    Ok(report)
}

fn summary(r: &Report) -> Vec<String> {
    let mut v = Vec::new();
    let fmt = |s: &Option<stats::Summary>| {
        s.as_ref()
            .map(|s| format!("p50 {:.1} ms, p99 {:.1} ms", s.p50_ms, s.p99_ms))
            .unwrap_or_else(|| "no successful sample".into())
    };
    for row in &r.create_latency.rows {
        v.push(format!(
            "create        c={:<3} {} ({} failed)",
            row.concurrency,
            fmt(&row.summary),
            row.failures
        ));
    }
    for row in &r.create_to_first_command.rows {
        v.push(format!(
            "create→echo   c={:<3} {} ({} failed)",
            row.concurrency,
            fmt(&row.summary),
            row.failures
        ));
    }
    if let Some(best) = r
        .throughput
        .rows
        .iter()
        .max_by(|a, b| a.creates_per_s.total_cmp(&b.creates_per_s))
    {
        v.push(format!(
            "peak throughput {:.1} creates/s ({} at c={})",
            best.creates_per_s, best.mode, best.concurrency
        ));
    }
    match (r.density.available, r.density.rows.last()) {
        (true, Some(d)) => v.push(format!(
            "density       {:.1} MiB per idle sandbox at {} live",
            d.per_sandbox_mib, d.live
        )),
        _ => v.push(format!(
            "density       not measured: {}",
            r.density.reason.clone().unwrap_or_default()
        )),
    }
    for (name, sec) in [
        ("pause/resume", &r.pause_resume),
        ("snapshot/clone", &r.snapshot_clone),
    ] {
        if !sec.available {
            v.push(format!(
                "{name:<13} not available: {}",
                sec.reason.clone().unwrap_or_default()
            ));
            continue;
        }
        for row in &sec.rows {
            let ops: Vec<String> = row
                .ops
                .iter()
                .map(|(k, o)| match (&o.unavailable, &o.summary) {
                    (Some(_), _) => format!("{k} n/a"),
                    (None, Some(s)) => format!("{k} {:.1} ms", s.p50_ms),
                    (None, None) => format!("{k} failed"),
                })
                .collect();
            v.push(format!(
                "{name:<13} {:>5} MiB dirty: {}",
                row.dirty_mib,
                ops.join(", ")
            ));
        }
    }
    v
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::Vmm(a)) => micro_main(a),
        Some(Cmd::Plot(a)) => plot_main(a),
        Some(Cmd::Soak(a)) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(soak::main(a)),
        None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(run_main(cli.run)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_and_levels() {
        assert_eq!(stamp(0), "19700101-000000");
        assert_eq!(stamp(1_796_000_000), "20261130-005320");
        assert_eq!(density_levels(1000), vec![100, 300, 500, 1000]);
        assert_eq!(density_levels(20), vec![20]);
        assert_eq!(density_levels(400), vec![100, 300, 400]);
        assert!(density_levels(0).is_empty());
    }

    #[test]
    fn cli_parses_quick_and_micro() {
        let c = Cli::try_parse_from([
            "cube-bench",
            "--quick",
            "--density-max",
            "12",
            "--concurrency",
            "1,2",
        ])
        .unwrap();
        assert!(c.run.quick && c.cmd.is_none());
        assert_eq!(c.run.concurrency, Some(vec![1, 2]));
        let p = plan(&c.run, true, "http://127.0.0.1:3000").unwrap();
        assert_eq!(p.density_levels, vec![12]);
        assert!(p.density_skip_reason.is_none());
        let p = plan(&c.run, false, "http://10.0.0.1:3000").unwrap();
        assert!(p.density_skip_reason.unwrap().contains("not on this host"));
        let c =
            Cli::try_parse_from(["cube-bench", "vmm", "--only", "vmm-bench,shim-bench"]).unwrap();
        assert!(matches!(c.cmd, Some(Cmd::Vmm(ref m)) if m.only.as_ref().unwrap().len() == 2));
        let c = Cli::try_parse_from(["cube-bench", "--concurrency", "0"]).unwrap();
        assert!(plan(&c.run, true, "x").is_err());
    }
}
