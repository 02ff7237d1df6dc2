//! `agent-bench`: measures cube-agent against its targets and writes a markdown table and JSON.
//!
//! (a) spawn → first `GET /health` 204, over many fresh agents;
//! (b) `process.Process/Start` of `true`, read to the end-stream envelope, over one reused
//!     HTTP/1.1 connection (plus the SDK-shaped `bash -l -c true` for reference);
//! (c) VmRSS after start and after the round-trip load.

mod agent;
mod http;
mod stats;

use std::fs;
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde::Serialize;
use serde_json::Value;

use crate::agent::Spawn;
use crate::http::Conn;
use crate::stats::{summarize, Summary};

const TARGET_RTT_P50_US: f64 = 2000.0;
const TARGET_RSS_KIB: u64 = 5 * 1024;
const TARGET_START_US: f64 = 5000.0;

#[derive(Parser, Debug)]
#[command(about = "Benchmark cube-agent: start time, Start round trip, idle RSS")]
struct Args {
    /// The cube-agent binary to measure.
    #[arg(long, env = "CUBE_AGENT_BIN")]
    agent_bin: PathBuf,
    /// Measured `Start(true)` round trips (after warm-up).
    #[arg(long, default_value_t = 2000)]
    iterations: usize,
    /// Warm-up round trips, not measured.
    #[arg(long, default_value_t = 200)]
    warmup: usize,
    /// Fresh agents started for the start-time measurement.
    #[arg(long, default_value_t = 50)]
    start_runs: usize,
    /// Round trips of the SDK-shaped `bash -l -c true` (reference only; 0 to skip).
    #[arg(long, default_value_t = 200)]
    bash_iterations: usize,
    /// Extra argument passed to the agent (repeatable), e.g. `--agent-arg=--default-user=root`.
    #[arg(long = "agent-arg", allow_hyphen_values = true)]
    agent_args: Vec<String>,
    /// Output directory (default: benches/results/agent-bench-<unix time>/).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Exit non-zero when a target is missed.
    #[arg(long)]
    fail_on_target: bool,
}

#[derive(Serialize)]
struct Check {
    metric: String,
    value: String,
    target: String,
    pass: Option<bool>,
}

#[derive(Serialize)]
struct Report {
    agent_bin: String,
    unix_time: u64,
    host_cpus: usize,
    iterations: usize,
    warmup: usize,
    start_to_health: Summary,
    start_true_rtt: Summary,
    start_bash_true_rtt: Option<Summary>,
    local_spawn_true: Summary,
    rss_after_start_kib: u64,
    rss_after_load_kib: u64,
    checks: Vec<Check>,
}

fn start_body(cmd: &str, args: &[&str]) -> Vec<u8> {
    let json = serde_json::json!({"process": {"cmd": cmd, "args": args}, "stdin": false});
    http::envelope(json.to_string().as_bytes())
}

/// One `process.Process/Start` round trip; returns its latency after checking the stream is a
/// well-formed, successful process run (checked after the clock stops).
fn start_roundtrip(conn: &mut Conn, body: &[u8]) -> Result<Duration> {
    let t0 = Instant::now();
    let r = conn.request(
        "POST",
        "/process.Process/Start",
        &[
            ("Content-Type", "application/connect+json"),
            ("Connect-Protocol-Version", "1"),
            ("Connect-Timeout-Ms", "60000"),
        ],
        body,
    )?;
    let dt = t0.elapsed();
    if r.status != 200 || !r.content_type.starts_with("application/connect+json") {
        bail!(
            "Start answered {} {}: {}",
            r.status,
            r.content_type,
            String::from_utf8_lossy(&r.body)
        );
    }
    let envs = http::envelopes(&r.body)?;
    let Some(((last_flags, last), msgs)) = envs.split_last() else {
        bail!("empty stream");
    };
    if *last_flags != 0x02 {
        bail!("stream did not end with an end-stream envelope");
    }
    let end: Value = serde_json::from_slice(last)?;
    if end.get("error").is_some() {
        bail!("end-stream error: {end}");
    }
    let events: Vec<Value> = msgs
        .iter()
        .map(|(_, m)| serde_json::from_slice(m))
        .collect::<Result<_, _>>()?;
    if events
        .first()
        .and_then(|e| e.pointer("/event/start"))
        .is_none()
    {
        bail!("first event is not start: {events:?}");
    }
    let exit = events
        .iter()
        .find_map(|e| e.pointer("/event/end"))
        .context("no end event")?;
    let code = exit.get("exitCode").and_then(Value::as_i64).unwrap_or(0);
    if code != 0 {
        bail!("true exited with {code}: {exit}");
    }
    Ok(dt)
}

fn ms(us: f64) -> String {
    format!("{:.3} ms", us / 1000.0)
}

fn mib(kib: u64) -> String {
    format!("{:.2} MiB", kib as f64 / 1024.0)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !args.agent_bin.is_file() {
        bail!("agent binary {} does not exist", args.agent_bin.display());
    }
    let unix_time = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let out = args.out.clone().unwrap_or_else(|| {
        let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        manifest
            .parent()
            .unwrap_or(manifest)
            .join("results")
            .join(format!("agent-bench-{unix_time}"))
    });
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    let quiet = Spawn {
        bin: &args.agent_bin,
        extra_args: &args.agent_args,
        log: None,
    };

    // (a) start → first /health 204, each on a fresh agent.
    eprintln!("start-to-health: {} runs", args.start_runs);
    let mut starts = Vec::with_capacity(args.start_runs);
    for _ in 0..args.start_runs {
        let (mut a, dt) = quiet.start(Duration::from_secs(10))?;
        starts.push(dt);
        a.stop();
    }
    let start_to_health = summarize(&starts);

    // (b) round trips over one connection, (c) RSS before and after them.
    let logged = Spawn {
        bin: &args.agent_bin,
        extra_args: &args.agent_args,
        log: Some(out.join("agent.log")),
    };
    let (mut agent, _) = logged.start(Duration::from_secs(10))?;
    thread::sleep(Duration::from_millis(300));
    let rss_after_start_kib = agent.rss_kib()?;

    let mut conn = Conn::connect(agent.addr, Duration::from_secs(2))?;
    let body_true = start_body("/bin/true", &[]);
    eprintln!(
        "Start(/bin/true): {} warm-up + {} measured",
        args.warmup, args.iterations
    );
    for _ in 0..args.warmup {
        start_roundtrip(&mut conn, &body_true)?;
    }
    let mut rtts = Vec::with_capacity(args.iterations);
    for _ in 0..args.iterations {
        rtts.push(start_roundtrip(&mut conn, &body_true)?);
    }
    let start_true_rtt = summarize(&rtts);

    let start_bash_true_rtt = if args.bash_iterations > 0 {
        eprintln!("Start(bash -l -c true): {} measured", args.bash_iterations);
        let body = start_body("/bin/bash", &["-l", "-c", "true"]);
        for _ in 0..10 {
            start_roundtrip(&mut conn, &body)?;
        }
        let mut v = Vec::with_capacity(args.bash_iterations);
        for _ in 0..args.bash_iterations {
            v.push(start_roundtrip(&mut conn, &body)?);
        }
        Some(summarize(&v))
    } else {
        None
    };
    drop(conn);
    // Context for the round trip: what fork/exec/wait of `true` costs on this host right now,
    // without the agent (the floor the agent's number sits on).
    let mut local = Vec::with_capacity(500);
    for _ in 0..500 {
        let t0 = Instant::now();
        std::process::Command::new("/bin/true").status()?;
        local.push(t0.elapsed());
    }
    let local_spawn_true = summarize(&local);
    thread::sleep(Duration::from_secs(1));
    let rss_after_load_kib = agent.rss_kib()?;
    agent.stop();

    let checks = vec![
        Check {
            metric: "start → first /health 204, p50".into(),
            value: ms(start_to_health.p50_us),
            target: "≤ 5 ms".into(),
            pass: Some(start_to_health.p50_us <= TARGET_START_US),
        },
        Check {
            metric: "start → first /health 204, p95".into(),
            value: ms(start_to_health.p95_us),
            target: "(info)".into(),
            pass: None,
        },
        Check {
            metric: "Start(/bin/true) round trip, p50".into(),
            value: ms(start_true_rtt.p50_us),
            target: "≤ 2 ms".into(),
            pass: Some(start_true_rtt.p50_us <= TARGET_RTT_P50_US),
        },
        Check {
            metric: "Start(/bin/true) round trip, p90 / p99 / max".into(),
            value: format!(
                "{} / {} / {}",
                ms(start_true_rtt.p90_us),
                ms(start_true_rtt.p99_us),
                ms(start_true_rtt.max_us)
            ),
            target: "(info)".into(),
            pass: None,
        },
        Check {
            metric: "Start(bash -l -c true) round trip, p50 / p99".into(),
            value: start_bash_true_rtt
                .as_ref()
                .map(|s| format!("{} / {}", ms(s.p50_us), ms(s.p99_us)))
                .unwrap_or_else(|| "skipped".into()),
            target: "(info: what sdk.commands.run(\"true\") asks for)".into(),
            pass: None,
        },
        Check {
            metric: "local spawn+wait of /bin/true without the agent, p50".into(),
            value: ms(local_spawn_true.p50_us),
            target: "(info: host floor)".into(),
            pass: None,
        },
        Check {
            metric: "idle RSS after start".into(),
            value: mib(rss_after_start_kib),
            target: "≤ 5 MiB".into(),
            pass: Some(rss_after_start_kib <= TARGET_RSS_KIB),
        },
        Check {
            metric: "idle RSS after round-trip load".into(),
            value: mib(rss_after_load_kib),
            target: "≤ 5 MiB".into(),
            pass: Some(rss_after_load_kib <= TARGET_RSS_KIB),
        },
    ];

    let mut md = format!(
        "## agent-bench — `{}`\n\n{} start runs, {} measured round trips after {} warm-up, {} CPUs\n\n\
         | metric | value | target | result |\n|---|---|---|---|\n",
        args.agent_bin.display(),
        args.start_runs,
        args.iterations,
        args.warmup,
        thread::available_parallelism().map_or(0, |n| n.get()),
    );
    for c in &checks {
        let result = match c.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "",
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            c.metric, c.value, c.target, result
        ));
    }
    print!("{md}");

    let failed = checks.iter().any(|c| c.pass == Some(false));
    let report = Report {
        agent_bin: args.agent_bin.display().to_string(),
        unix_time,
        host_cpus: thread::available_parallelism().map_or(0, |n| n.get()),
        iterations: args.iterations,
        warmup: args.warmup,
        start_to_health,
        start_true_rtt,
        start_bash_true_rtt,
        local_spawn_true,
        rss_after_start_kib,
        rss_after_load_kib,
        checks,
    };
    fs::write(out.join("summary.md"), &md)?;
    fs::write(
        out.join("agent-bench.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    eprintln!("wrote {}", out.display());
    if failed && args.fail_on_target {
        bail!("targets missed");
    }
    Ok(())
}
