//! `node-bench --runtime microvm`: a real cubelet on the microvm runtime with the shim's
//! `agent_standin` test guest (what stands in: the guest; everything else is real):
//! * CreateSandbox from a warm shim pool → guest running and its init acknowledged, p50/p99;
//! * N idle sandboxes of 512 MiB restored from one snapshot: host memory per sandbox, and the
//!   shims' own accounting (PSS minus the pages the guest wrote);
//! * PauseSandbox (pause to disk, memory released) and ResumeSandbox through the shim.

use anyhow::{bail, Context};
use cube_proto::nodev1 as pb;
use cube_proto::nodev1::node_client::NodeClient;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, meminfo, pct, start};

pub struct Opts {
    pub cubelet: PathBuf,
    pub shim: PathBuf,
    /// "agent-standin", or a Linux guest kernel.
    pub guest: String,
    /// The static cube-agent (Linux guests).
    pub agent: Option<PathBuf>,
    pub out: PathBuf,
    pub iterations: usize,
    pub idle: usize,
    pub pool: u32,
    pub unix: u64,
}

fn config(
    root: &Path,
    o: &Opts,
    pool: u32,
    name: &str,
) -> anyhow::Result<(PathBuf, String, String)> {
    let shim = &o.shim;
    let (g, h) = (free_port()?, free_port()?);
    let cfg = format!(
        "grpc_addr = \"127.0.0.1:{g}\"\nhttp_addr = \"127.0.0.1:{h}\"\ndata_dir = \"{r}/data\"\nrun_dir = \"{r}/run\"\ncache_dir = \"{r}/cache\"\nagent_binary = \"{r}/agent\"\n\
         runtime = \"microvm\"\n[microvm]\nshim_binary = \"{s}\"\nguest = \"{guest}\"\ntaps = 8\n\
         [storage]\nxfs_loop_image = \"{r}/xfs.img\"\nxfs_loop_size_gib = 8\n\
         [sandbox]\ndefault_vcpus = 1\ndefault_memory_mib = 512\nready_timeout_ms = 30000\nmax_sandboxes = 0\n[cgroup]\nparent = \"cube-bench-{p}\"\n\
         [pools]\nnetwork = 0\ndisks = {d}\nrefill_interval_ms = 10\n[network]\nswitch = \"none\"\n[pools.started]\n{started}\n",
        r = root.display(),
        s = shim.display(),
        guest = o.guest,
        p = std::process::id(),
        d = if pool > 0 { 8 } else { 0 },
        started = if pool > 0 { format!("tiny = {pool}") } else { String::new() },
    );
    let p = root.join(format!("cubelet-{name}.toml"));
    std::fs::write(&p, cfg)?;
    Ok((p, format!("http://127.0.0.1:{g}"), format!("127.0.0.1:{h}")))
}

fn req(id: &str) -> pb::CreateSandboxRequest {
    pb::CreateSandboxRequest {
        template: "tiny".into(),
        sandbox_id: id.into(),
        shape: Some(pb::Shape {
            vcpus: 1,
            memory_mib: 512,
            disk_mib: 0,
        }),
        env_vars: [("BENCH".to_string(), "1".to_string())]
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

fn shim_stats(root: &Path, id: &str) -> anyhow::Result<cube_shim::protocol::Stats> {
    let mut c =
        cube_shim::Client::connect(&root.join("data/sandboxes").join(id).join("shim.sock"))?;
    c.set_timeout(Some(Duration::from_secs(30)))?;
    match c.call(cube_shim::Op::Stats)? {
        cube_shim::Reply::Stats { stats, .. } => Ok(stats),
        r => bail!("unexpected reply {r:?}"),
    }
}

async fn wait_pool(cl: &mut NodeClient<tonic::transport::Channel>, n: u32) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let st = cl.node_status(pb::NodeStatusRequest {}).await?.into_inner();
        if st.pools.iter().any(|p| p.pool == "shim" && p.ready >= n) {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!("shim pool did not fill: {:?}", st.pools);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub async fn run(o: Opts) -> anyhow::Result<()> {
    let root = PathBuf::from(format!("/var/tmp/node-bench-mvm-{}", std::process::id()));
    std::fs::create_dir_all(root.join("tpl"))?;
    std::fs::write(root.join("tpl/hello"), b"bench template\n")?;
    match &o.agent {
        // A Linux guest runs the template: host programs and the real agent as its init.
        Some(agent) if o.guest != "agent-standin" => {
            let st = Command::new(&o.cubelet)
                .arg("host-root")
                .arg(root.join("tpl"))
                .args(["--programs", "sh,echo,true"])
                .stdout(Stdio::null())
                .status()?;
            if !st.success() {
                bail!("assembling the host-root template failed");
            }
            std::fs::copy(agent, root.join("agent"))?;
        }
        _ => std::fs::write(root.join("agent"), b"#!/bin/sh\n")?,
    }
    let log = root.join("cubelet.log");
    let r = run_in(&o, &root, &log).await;
    let _ = std::fs::copy(&log, o.out.join("cubelet.log"));
    for h in ["", "cpu", "memory", "pids", "freezer"] {
        let d = Path::new("/sys/fs/cgroup")
            .join(h)
            .join(format!("cube-bench-{}", std::process::id()));
        if let Ok(rd) = std::fs::read_dir(&d) {
            for e in rd.flatten() {
                let _ = std::fs::remove_dir(e.path());
            }
        }
        let _ = std::fs::remove_dir(d);
    }
    let data = std::ffi::CString::new(format!("{}/data", root.display()))?;
    // SAFETY: unmount the XFS data image cubelet mounted for this run.
    unsafe { libc::umount2(data.as_ptr(), libc::MNT_DETACH) };
    let _ = std::fs::remove_dir_all(&root);
    r
}

async fn run_in(o: &Opts, root: &Path, log: &Path) -> anyhow::Result<()> {
    let (cfg_w, grpc_w, http_w) = config(root, o, o.pool, "warm")?;
    let st = Command::new(&o.cubelet)
        .arg("--config")
        .arg(&cfg_w)
        .args(["build-template", "tiny", "--dir"])
        .arg(root.join("tpl"))
        .stdout(Stdio::null())
        .status()?;
    if !st.success() {
        bail!("building the tiny template failed");
    }

    // Warm shim pool: create → restored and init acknowledged.
    eprintln!("microvm warm-pool creates ({})...", o.iterations);
    let (mut wc, mut ws, mut from_pool) = (Vec::new(), Vec::new(), 0usize);
    let (mut pause_ms, mut resume_ms) = (Vec::new(), Vec::new());
    let phases;
    {
        let (_d, mut cl) = start(&o.cubelet, &cfg_w, &grpc_w, log).await?;
        for i in 0..o.iterations {
            // A quiet node: the pool refilled after the last create (no shim spawning meanwhile).
            wait_pool(&mut cl, o.pool.max(1)).await?;
            let id = format!("w{i}");
            let t = Instant::now();
            let sb = cl
                .create_sandbox(req(&id))
                .await
                .with_context(|| format!("create {id}"))?
                .into_inner();
            wc.push(t.elapsed().as_secs_f64() * 1e3);
            ws.push(sb.create_latency_us as f64 / 1e3);
            from_pool += usize::from(sb.from_pool);
            // Pause to disk / resume on a few of them.
            if i < 20 {
                let t = Instant::now();
                cl.pause_sandbox(pb::PauseSandboxRequest {
                    sandbox_id: id.clone(),
                    ..Default::default()
                })
                .await?;
                pause_ms.push(t.elapsed().as_secs_f64() * 1e3);
                let t = Instant::now();
                cl.resume_sandbox(pb::ResumeSandboxRequest {
                    sandbox_id: id.clone(),
                    ..Default::default()
                })
                .await?;
                resume_ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            cl.kill_sandbox(pb::SandboxRef { sandbox_id: id }).await?;
        }
        phases = create_phases(&http_w).unwrap_or_default();
    }

    // Idle: N sandboxes of 512 MiB from one snapshot.
    eprintln!("microvm idle memory ({} sandboxes of 512 MiB)...", o.idle);
    let (cfg_i, grpc_i, _) = config(root, o, 0, "idle")?;
    let (done, elapsed, avail_kib, pss_kib, beyond_kib, anon_kib, rss_kib) = {
        let (_d, mut cl) = start(&o.cubelet, &cfg_i, &grpc_i, log).await?;
        // The template snapshot exists already (built by the warm run).
        cl.create_sandbox(req("prime")).await?;
        cl.kill_sandbox(pb::SandboxRef {
            sandbox_id: "prime".into(),
        })
        .await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let avail0 = meminfo("MemAvailable:");
        let t = Instant::now();
        let mut done = 0usize;
        let mut tasks = Vec::new();
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(8));
        for i in 0..o.idle {
            let mut c = cl.clone();
            let sem = sem.clone();
            tasks.push(tokio::spawn(async move {
                let _p = sem.acquire().await;
                c.create_sandbox(req(&format!("idle{i}"))).await
            }));
        }
        for t in tasks {
            match t.await? {
                Ok(_) => done += 1,
                Err(e) => eprintln!("create failed: {e}"),
            }
        }
        let elapsed = t.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let avail1 = meminfo("MemAvailable:");
        let (mut pss, mut anon, mut rss) = (0u64, 0u64, 0u64);
        for i in 0..o.idle {
            if let Ok(s) = shim_stats(root, &format!("idle{i}")) {
                pss += s.process_pss_kib;
                anon += s.guest_anon_kib;
                rss += s.guest_rss_kib;
            }
        }
        let n = done.max(1) as u64;
        (
            done,
            elapsed,
            avail0.saturating_sub(avail1) / n,
            pss / n,
            pss.saturating_sub(anon) / n,
            anon / n,
            rss / n,
        )
    };

    let mut md = String::new();
    let guest = if o.guest == "agent-standin" {
        "agent stand-in test guest".to_string()
    } else {
        format!("Linux guest {}, cube-agent as init", o.guest)
    };
    md.push_str(&format!(
        "## node-bench: microvm runtime (cube-shim + KVM, {guest})\n\n"
    ));
    md.push_str("| measure | n | p50 ms | p99 ms | target |\n|---|---|---|---|---|\n");
    md.push_str(&format!(
        "| CreateSandbox, warm shim pool (node: request → restored + init acknowledged) | {} ({} from pool) | {:.2} | {:.2} | p50 ≤ 2 ms |\n",
        ws.len(), from_pool, pct(&mut ws.clone(), 0.5), pct(&mut ws.clone(), 0.99)
    ));
    md.push_str(&format!(
        "| CreateSandbox, warm shim pool (client, gRPC round trip) | {} | {:.2} | {:.2} | |\n",
        wc.len(),
        pct(&mut wc.clone(), 0.5),
        pct(&mut wc.clone(), 0.99)
    ));
    md.push_str(&format!(
        "| PauseSandbox (pause to disk, 512 MiB guest, memory released) | {} | {:.2} | {:.2} | |\n",
        pause_ms.len(),
        pct(&mut pause_ms.clone(), 0.5),
        pct(&mut pause_ms.clone(), 0.99)
    ));
    md.push_str(&format!(
        "| ResumeSandbox (restore from pause dir + fresh init) | {} | {:.2} | {:.2} | |\n",
        resume_ms.len(),
        pct(&mut resume_ms.clone(), 0.5),
        pct(&mut resume_ms.clone(), 0.99)
    ));
    md.push_str("\nWhere a warm create's time goes (cubelet's `cube_create_phase_seconds`, mean ms; `shim`, `disk` and `tap` run at once):\n\n| phase | mean ms |\n|---|---|\n");
    for (ph, ms) in &phases {
        md.push_str(&format!("| {ph} | {ms:.3} |\n"));
    }
    md.push_str("\n## Idle 512 MiB microVM sandboxes from one snapshot\n\n| sandboxes | create time s | host MemAvailable drop / sandbox KiB | shim PSS / sandbox KiB | PSS beyond guest-written pages / sandbox KiB | guest-written (anon) / sandbox KiB | guest resident / sandbox KiB | target |\n|---|---|---|---|---|---|---|---|\n");
    md.push_str(&format!(
        "| {done} | {elapsed:.1} | {avail_kib} | {pss_kib} | {beyond_kib} | {anon_kib} | {rss_kib} | ≤ 8192 KiB beyond written pages |\n"
    ));
    println!("{md}");
    let json = serde_json::json!({
        "bench": "node-bench",
        "runtime": "microvm",
        "guest": o.guest,
        "unix_time": o.unix,
        "warm_pool": {"n": ws.len(), "from_pool": from_pool, "node_ms_p50": pct(&mut ws.clone(), 0.5), "node_ms_p99": pct(&mut ws.clone(), 0.99), "client_ms_p50": pct(&mut wc.clone(), 0.5), "client_ms_p99": pct(&mut wc.clone(), 0.99), "node_ms": ws, "target_p50_ms": 2},
        "create_phases_mean_ms": phases.iter().cloned().collect::<std::collections::BTreeMap<String, f64>>(),
        "pause_to_disk_ms": {"p50": pct(&mut pause_ms.clone(), 0.5), "p99": pct(&mut pause_ms.clone(), 0.99), "all": pause_ms},
        "resume_ms": {"p50": pct(&mut resume_ms.clone(), 0.5), "p99": pct(&mut resume_ms.clone(), 0.99), "all": resume_ms},
        "idle": {"sandboxes": done, "memory_mib": 512, "create_seconds": elapsed, "host_mem_available_drop_kib_per_sandbox": avail_kib, "shim_pss_kib_per_sandbox": pss_kib, "pss_beyond_written_kib_per_sandbox": beyond_kib, "guest_written_kib_per_sandbox": anon_kib, "guest_rss_kib_per_sandbox": rss_kib, "target_beyond_written_kib": 8192},
    });
    std::fs::write(
        o.out.join("results-microvm.json"),
        serde_json::to_vec_pretty(&json)?,
    )?;
    std::fs::write(o.out.join("results-microvm.md"), md)?;
    eprintln!("results in {}", o.out.display());
    Ok(())
}

/// Phases of a microVM create (`shim`, `disk` and `tap` run at once).
const PHASES: [&str; 6] = ["shim", "disk", "tap", "restore", "init", "total"];

/// Mean ms per create phase from cubelet's metrics (`cube_create_phase_seconds`).
fn create_phases(http: &str) -> anyhow::Result<Vec<(String, f64)>> {
    Ok(crate::phase_sums(http, &PHASES)?
        .into_iter()
        .filter(|(_, n, _)| *n > 0.0)
        .map(|(ph, n, sum)| (ph, sum / n * 1e3))
        .collect())
}
