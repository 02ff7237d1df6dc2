//! `node-bench`: runs a real cubelet (namespace runtime, `--runtime gvisor`, or `--runtime microvm`, see
//! [`microvm`]) and measures
//! * CreateSandbox → agent healthy (+ /init) with a warm pool of pre-started sandboxes, and cold;
//! * host memory per idle sandbox with many idle sandboxes.
//!
//! Prints a markdown table and writes JSON to `--out DIR` (default
//! `benches/results/node-bench-<unix time>/`). Needs root.

use anyhow::{bail, Context};
use clap::Parser;
use cube_proto::nodev1 as pb;
use cube_proto::nodev1::node_client::NodeClient;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[cfg(feature = "microvm")]
mod microvm;

#[derive(Parser)]
#[command(about = "cubelet node benchmarks (namespace, gvisor or microvm runtime)")]
struct Args {
    /// Output directory for results.json and results.md.
    #[arg(long)]
    out: Option<PathBuf>,
    /// cubelet binary (default: next to this binary).
    #[arg(long)]
    cubelet: Option<PathBuf>,
    /// cube-agent binary (default: next to this binary, then $CUBE_AGENT_BIN).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Creates measured per mode.
    #[arg(long, default_value_t = 100)]
    iterations: usize,
    /// Idle sandboxes for the memory measurement.
    #[arg(long, default_value_t = 200)]
    idle: usize,
    /// Pre-started sandboxes kept in the warm pool.
    #[arg(long, default_value_t = 4)]
    pool: u32,
    /// "namespace" (default), "gvisor" (runsc) or "microvm" (cube-shim + KVM with the agent
    /// stand-in guest).
    #[arg(long, default_value = "namespace")]
    runtime: String,
    /// cube-shim binary for --runtime microvm (default: next to this binary).
    #[arg(long)]
    #[cfg_attr(not(feature = "microvm"), allow(dead_code))]
    shim: Option<PathBuf>,
    /// Guest for --runtime microvm: "agent-standin" (the shim's test guest) or a Linux guest
    /// kernel (vmlinux from deploy/guest-kernel; the template is then a host-root with the
    /// static cube-agent, given with --agent or $CUBE_AGENT_BIN).
    #[arg(long, default_value = "agent-standin")]
    #[cfg_attr(not(feature = "microvm"), allow(dead_code))]
    guest: String,
}

pub(crate) struct Daemon {
    child: Child,
    grpc: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: signal our own child; it kills its sandboxes on SIGTERM (--kill-sandboxes-on-exit).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(120) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn write_config(
    root: &Path,
    agent: &Path,
    pool: u32,
    net: u32,
    runtime: &str,
) -> anyhow::Result<(PathBuf, String, String)> {
    let (g, h) = (free_port()?, free_port()?);
    let started = if pool > 0 {
        format!("mini = {pool}")
    } else {
        String::new()
    };
    let cfg = format!(
        "runtime = \"{runtime}\"\ngrpc_addr = \"127.0.0.1:{g}\"\nhttp_addr = \"127.0.0.1:{h}\"\ndata_dir = \"{r}/data\"\nrun_dir = \"{r}/run\"\ncache_dir = \"{r}/cache\"\nagent_binary = \"{a}\"\n\
         [storage]\nxfs_loop_image = \"{r}/xfs.img\"\nxfs_loop_size_gib = 8\n\
         [sandbox]\ntmp_size_mib = 16\nready_timeout_ms = 30000\n[cgroup]\nparent = \"cube-bench-{p}\"\n\
         [pools]\nnetwork = {net}\ndisks = {d}\ndisk_templates = [{dt}]\nrefill_interval_ms = 20\n[pools.started]\n{started}\n",
        r = root.display(),
        a = agent.display(),
        p = std::process::id(),
        d = if pool > 0 { 4 } else { 0 },
        dt = if pool > 0 { "\"mini\"" } else { "" },
    );
    let p = root.join(format!("cubelet-{pool}.toml"));
    std::fs::write(&p, cfg)?;
    Ok((p, format!("http://127.0.0.1:{g}"), format!("127.0.0.1:{h}")))
}

pub(crate) async fn start(
    cubelet: &Path,
    cfg: &Path,
    grpc: &str,
    log: &Path,
) -> anyhow::Result<(Daemon, NodeClient<tonic::transport::Channel>)> {
    let logf = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let child = Command::new(cubelet)
        .arg("--config")
        .arg(cfg)
        .args(["--log", "warn", "run", "--kill-sandboxes-on-exit"])
        .stdout(Stdio::null())
        .stderr(logf)
        .spawn()
        .context("starting cubelet")?;
    let mut d = Daemon {
        child,
        grpc: grpc.into(),
    };
    let t = Instant::now();
    loop {
        if let Ok(mut c) = NodeClient::connect(d.grpc.clone()).await {
            if c.node_status(pb::NodeStatusRequest {}).await.is_ok() {
                return Ok((d, c));
            }
        }
        if let Ok(Some(st)) = d.child.try_wait() {
            bail!("cubelet exited ({st}); see {}", log.display());
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!("cubelet did not start; see {}", log.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn req(id: &str) -> pb::CreateSandboxRequest {
    pb::CreateSandboxRequest {
        template: "mini".into(),
        sandbox_id: id.into(),
        shape: Some(pb::Shape {
            vcpus: 1,
            memory_mib: 256,
            disk_mib: 0,
        }),
        ..Default::default()
    }
}

/// Phases of the no-pool create path, in the order they happen (`prepare` is the wall time
/// of disk + endpoint (the netns) + cgroup, which run concurrently; `veth` and `policy` run
/// while `launch` does).
const PHASES: [&str; 10] = [
    "disk", "endpoint", "cgroup", "prepare", "launch", "veth", "policy", "healthy", "init", "total",
];

/// Scrapes cubelet's `/metrics` and returns (phase, count, sum seconds) from
/// `cube_create_phase_seconds`.
pub(crate) fn phase_sums(http: &str, phases: &[&str]) -> anyhow::Result<Vec<(String, f64, f64)>> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(http).with_context(|| format!("connect {http}"))?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        c,
        "GET /metrics HTTP/1.0\r\nHost: {http}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    c.read_to_string(&mut body)?;
    let mut out = Vec::new();
    for ph in phases {
        let get = |suffix: &str| -> f64 {
            let pre = format!("cube_create_phase_seconds_{suffix}{{phase=\"{ph}\"}} ");
            body.lines()
                .find_map(|l| l.strip_prefix(pre.as_str()))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0.0)
        };
        out.push((ph.to_string(), get("count"), get("sum")));
    }
    Ok(out)
}

pub(crate) fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

pub(crate) fn meminfo(key: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

struct Series {
    client_ms: Vec<f64>,
    server_ms: Vec<f64>,
    from_pool: usize,
}

async fn measure(
    cl: &mut NodeClient<tonic::transport::Channel>,
    name: &'static str,
    n: usize,
    wait_pool: bool,
) -> anyhow::Result<Series> {
    let mut s = Series {
        client_ms: vec![],
        server_ms: vec![],
        from_pool: 0,
    };
    for i in 0..n {
        if wait_pool {
            let t = Instant::now();
            loop {
                let st = cl.node_status(pb::NodeStatusRequest {}).await?.into_inner();
                if st.pools.iter().any(|p| p.pool == "started" && p.ready >= 1)
                    || t.elapsed() > Duration::from_secs(30)
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let id = format!("b{name}{i}").replace('-', "");
        let t = Instant::now();
        let sb = cl
            .create_sandbox(req(&id))
            .await
            .with_context(|| format!("create {id}"))?
            .into_inner();
        s.client_ms.push(t.elapsed().as_secs_f64() * 1e3);
        s.server_ms.push(sb.create_latency_us as f64 / 1e3);
        s.from_pool += usize::from(sb.from_pool);
        cl.kill_sandbox(pb::SandboxRef { sandbox_id: id }).await?;
    }
    Ok(s)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("node-bench needs root (namespaces, cgroups, loop devices, veths)");
    }
    let me = std::env::current_exe()?;
    let dir = me.parent().map(Path::to_path_buf).unwrap_or_default();
    let cubelet = a.cubelet.clone().unwrap_or_else(|| dir.join("cubelet"));
    #[cfg(not(feature = "microvm"))]
    if a.runtime == "microvm" {
        bail!("--runtime microvm: build node-bench with `--features microvm`");
    }
    #[cfg(feature = "microvm")]
    if a.runtime == "microvm" {
        let shim = a.shim.clone().unwrap_or_else(|| dir.join("cube-shim"));
        for (what, p) in [("cubelet", &cubelet), ("cube-shim", &shim)] {
            if !p.exists() {
                bail!(
                    "{what} binary {} not found (build it, or pass its path)",
                    p.display()
                );
            }
        }
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        let out = a
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("benches/results/node-bench-microvm-{unix}")));
        std::fs::create_dir_all(&out)?;
        let agent = a
            .agent
            .clone()
            .or_else(|| std::env::var("CUBE_AGENT_BIN").ok().map(PathBuf::from));
        if a.guest != "agent-standin" && !agent.as_ref().is_some_and(|p| p.exists()) {
            bail!("a Linux guest needs the static cube-agent: pass --agent or set CUBE_AGENT_BIN");
        }
        return microvm::run(microvm::Opts {
            cubelet,
            shim,
            guest: a.guest.clone(),
            agent,
            out,
            iterations: a.iterations,
            idle: a.idle,
            pool: a.pool,
            unix,
        })
        .await;
    } else if !["namespace", "gvisor"].contains(&a.runtime.as_str()) {
        bail!("--runtime: \"namespace\", \"gvisor\" or \"microvm\"");
    }
    let agent = a
        .agent
        .clone()
        .or_else(|| std::env::var("CUBE_AGENT_BIN").ok().map(PathBuf::from))
        .unwrap_or_else(|| dir.join("cube-agent"));
    for (what, p) in [("cubelet", &cubelet), ("cube-agent", &agent)] {
        if !p.exists() {
            bail!(
                "{what} binary {} not found (build it, or pass --{})",
                p.display(),
                if what == "cubelet" {
                    "cubelet"
                } else {
                    "agent"
                }
            );
        }
    }
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("benches/results/node-bench-{unix}")));
    std::fs::create_dir_all(&out)?;
    let root = PathBuf::from(format!("/var/tmp/node-bench-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let host = root.join("hostroot");
    let st = Command::new(&cubelet)
        .arg("host-root")
        .arg(&host)
        .status()?;
    if !st.success() {
        bail!("assembling the host-root template failed");
    }
    let (cfg0, grpc0, http0) = write_config(&root, &agent, 0, 0, &a.runtime)?;
    let st = Command::new(&cubelet)
        .arg("--config")
        .arg(&cfg0)
        .args(["build-template", "mini", "--dir"])
        .arg(&host)
        .stdout(Stdio::null())
        .status()?;
    if !st.success() {
        bail!("building the mini template failed");
    }
    let log = root.join("cubelet.log");

    // Cold: no pools at all.
    eprintln!("cold creates ({})...", a.iterations);
    let cold = {
        let (_d, mut cl) = start(&cubelet, &cfg0, &grpc0, &log).await?;
        let s = measure(&mut cl, "cold", a.iterations, false).await?;
        (s, phase_sums(&http0, &PHASES)?)
    };
    let (cold, phases) = cold;
    // Warm: pre-started sandboxes waiting for /init.
    eprintln!("warm-pool creates ({})...", a.iterations);
    let (cfg1, grpc1, _) = write_config(&root, &agent, a.pool, 8, &a.runtime)?;
    let warm = {
        let (_d, mut cl) = start(&cubelet, &cfg1, &grpc1, &log).await?;
        measure(&mut cl, "warm", a.iterations, true).await?
    };
    // Idle memory: many sandboxes, nothing running in them but the agent.
    eprintln!("idle memory ({} sandboxes)...", a.idle);
    let (cfg2, grpc2, _) = write_config(&root, &agent, 0, 0, &a.runtime)?;
    let (idle_done, per_sb_kib, cg_kib, slab_kib, elapsed_s) = {
        let (_d, mut cl) = start(&cubelet, &cfg2, &grpc2, &log).await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let avail0 = meminfo("MemAvailable:");
        let slab0 = meminfo("Slab:");
        let t = Instant::now();
        let mut done = 0;
        for i in 0..a.idle {
            match cl.create_sandbox(req(&format!("idle{i}"))).await {
                Ok(_) => done += 1,
                Err(e) => {
                    eprintln!("stopped at {i}: {e}");
                    break;
                }
            }
        }
        let elapsed = t.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let avail1 = meminfo("MemAvailable:");
        let slab1 = meminfo("Slab:");
        let mut cg_total = 0u64;
        let cgroot = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            PathBuf::from("/sys/fs/cgroup")
        } else {
            PathBuf::from("/sys/fs/cgroup/memory")
        };
        if let Ok(rd) = std::fs::read_dir(cgroot.join(format!("cube-bench-{}", std::process::id())))
        {
            for e in rd.flatten() {
                for f in ["memory.current", "memory.usage_in_bytes"] {
                    if let Ok(s) = std::fs::read_to_string(e.path().join(f)) {
                        cg_total += s.trim().parse::<u64>().unwrap_or(0);
                    }
                }
            }
        }
        let n = done.max(1) as u64;
        (
            done,
            avail0.saturating_sub(avail1) / n,
            cg_total / 1024 / n,
            slab1.saturating_sub(slab0) / n,
            elapsed,
        )
    };
    let _ = std::fs::copy(&log, out.join("cubelet.log"));
    for h in ["", "cpu", "memory", "pids", "freezer"] {
        let _ = std::fs::remove_dir(
            Path::new("/sys/fs/cgroup")
                .join(h)
                .join(format!("cube-bench-{}", std::process::id())),
        );
    }
    let data = std::ffi::CString::new(format!("{}/data", root.display()))?;
    // SAFETY: unmount the XFS data image we mounted (via cubelet) for this run.
    unsafe { libc::umount2(data.as_ptr(), 0) };
    let _ = std::fs::remove_dir_all(&root);

    let mut cold_c = cold.client_ms.clone();
    let mut cold_s = cold.server_ms.clone();
    let mut warm_c = warm.client_ms.clone();
    let mut warm_s = warm.server_ms.clone();
    let row =
        |name: &str, c: &mut Vec<f64>, s: &mut Vec<f64>, pool: usize, n: usize, target: &str| {
            format!(
                "| {name} | {n} | {pool} | {:.2} | {:.2} | {:.2} | {:.2} | {target} |",
                pct(c, 0.5),
                pct(c, 0.99),
                pct(s, 0.5),
                pct(s, 0.99)
            )
        };
    let mut md = String::new();
    md.push_str(&format!(
        "## node-bench: CreateSandbox → agent ready ({} runtime, isolation {})\n\n",
        a.runtime,
        cube_proto::isolation::of(&a.runtime)
    ));
    md.push_str("| mode | n | from pool | client p50 ms | client p99 ms | node p50 ms | node p99 ms | target p50 |\n|---|---|---|---|---|---|---|---|\n");
    md.push_str(&row(
        "warm pool",
        &mut warm_c,
        &mut warm_s,
        warm.from_pool,
        warm.client_ms.len(),
        "≤ 5 ms",
    ));
    md.push('\n');
    md.push_str(&row(
        "no pool",
        &mut cold_c,
        &mut cold_s,
        cold.from_pool,
        cold.client_ms.len(),
        "≤ 50 ms",
    ));
    md.push_str("\n\n## No-pool create: mean per phase (cubelet `cube_create_phase_seconds`)\n\n| phase | n | mean ms |\n|---|---|---|\n");
    let mut phase_json = serde_json::Map::new();
    for (ph, n, sum) in &phases {
        let mean = if *n > 0.0 { sum / n * 1e3 } else { 0.0 };
        md.push_str(&format!("| {ph} | {n} | {mean:.2} |\n"));
        phase_json.insert(ph.clone(), serde_json::json!({"n": n, "mean_ms": mean}));
    }
    md.push_str("\n(disk, endpoint (netns) and cgroup run concurrently: `prepare` is their wall time; `veth` and `policy` run while `launch` does, or before it on gvisor, whose network stack takes the wired veth at start.)");
    md.push_str("\n\n## Idle sandboxes\n\n| sandboxes | create time s | host MemAvailable drop / sandbox KiB | cgroup memory / sandbox KiB | slab / sandbox KiB |\n|---|---|---|---|---|\n");
    md.push_str(&format!(
        "| {idle_done} | {elapsed_s:.1} | {per_sb_kib} | {cg_kib} | {slab_kib} |\n"
    ));
    println!("{md}");
    let json = serde_json::json!({
        "bench": "node-bench",
        "unix_time": unix,
        "runtime": a.runtime,
        "isolation": cube_proto::isolation::of(&a.runtime),
        "warm_pool": {"n": warm.client_ms.len(), "from_pool": warm.from_pool, "client_ms_p50": pct(&mut warm_c, 0.5), "client_ms_p99": pct(&mut warm_c, 0.99), "node_ms_p50": pct(&mut warm_s, 0.5), "node_ms_p99": pct(&mut warm_s, 0.99), "client_ms": warm.client_ms, "target_p50_ms": 5},
        "no_pool": {"n": cold.client_ms.len(), "client_ms_p50": pct(&mut cold_c, 0.5), "client_ms_p99": pct(&mut cold_c, 0.99), "node_ms_p50": pct(&mut cold_s, 0.5), "node_ms_p99": pct(&mut cold_s, 0.99), "client_ms": cold.client_ms, "target_p50_ms": 50, "phases_mean": phase_json},
        "idle": {"sandboxes": idle_done, "create_seconds": elapsed_s, "host_mem_available_drop_kib_per_sandbox": per_sb_kib, "cgroup_memory_kib_per_sandbox": cg_kib, "slab_kib_per_sandbox": slab_kib},
    });
    std::fs::write(out.join("results.json"), serde_json::to_vec_pretty(&json)?)?;
    std::fs::write(out.join("results.md"), md)?;
    eprintln!("results in {}", out.display());
    Ok(())
}
