//! `shim-bench --out DIR`: through real `cube-shim` processes and their control sockets,
//! measures (1) time from sending `restore` to a pre-spawned shim until the guest runs
//! (the restore reply, and the guest's first pause point after its first instruction; also
//! into shims started with `--template`, and from a template with virtio-net + virtio-vsock
//! devices, whose backends the shim opens on restore),
//! (2) host memory per idle shim with N shims restored from one 512 MiB template, beyond the
//! pages their guests wrote, (3) pause-to-disk of a guest that dirtied 64 MiB and resume in a
//! new shim. Templates live in /dev/shm (page cache). Prints a markdown table, writes
//! `shim-bench.json` to DIR.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::virtio::{MmioTransport, Net, Vsock};
use cube_hypervisor::{test_guests, DeviceStates, RunOutcome, Shape, Vmm};
use cube_shim::devices;
use cube_shim::protocol::{GuestStatus, Reply, Stats};
use cube_shim::{Client, Op};

#[derive(Parser)]
#[command(name = "shim-bench")]
struct Cli {
    /// Output directory (default benches/results/shim-bench-<unix time>/).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The cube-shim binary (default: next to this binary).
    #[arg(long)]
    shim: Option<PathBuf>,
    /// Restore samples (one pre-spawned shim each).
    #[arg(long, default_value_t = 30)]
    iterations: usize,
    /// Shims kept idle for the memory measurement.
    #[arg(long, default_value_t = 20)]
    shims: usize,
    /// Guest memory of the templates, MiB.
    #[arg(long, default_value_t = 512)]
    mem_mib: u32,
    /// Template working set (written before the snapshot), MiB.
    #[arg(long, default_value_t = 16)]
    working_set_mib: u64,
    /// Memory the guest dirties after restore for the pause-to-disk run, MiB.
    #[arg(long, default_value_t = 64)]
    dirty_mib: u64,
}

struct ShimProc {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl ShimProc {
    fn spawn(bin: &Path, shape: Shape) -> Result<ShimProc> {
        Self::spawn_with(bin, shape, &[])
    }

    fn spawn_with(bin: &Path, shape: Shape, extra: &[&std::ffi::OsStr]) -> Result<ShimProc> {
        let dir = tempfile::Builder::new()
            .prefix("shim-bench-")
            .tempdir_in("/dev/shm")?;
        let socket = dir.path().join("s.sock");
        let child = Command::new(bin)
            .args([
                "--vcpus",
                &shape.vcpus.to_string(),
                "--mem-mib",
                &shape.mem_mib.to_string(),
            ])
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let mut p = ShimProc {
            child,
            socket,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = p.child.try_wait()? {
                bail!("shim exited: {st}");
            }
            if let Ok(mut c) = Client::connect(&p.socket) {
                if c.call(Op::Ping).is_ok() {
                    return Ok(p);
                }
            }
            if Instant::now() > deadline {
                bail!("shim did not come up");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    fn client(&self) -> Result<Client> {
        Ok(Client::connect(&self.socket)?)
    }
}

impl Drop for ShimProc {
    fn drop(&mut self) {
        if let Ok(mut c) = Client::connect(&self.socket) {
            let _ = c.call(Op::Stop);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Bench guest template: wrote `ws` bytes (one word per page), will dirty `dirty` bytes from
/// DATA + ws after the restore, then stop at pause point 3.
fn template(dir: &Path, shape: Shape, ws: u64, dirty: u64) -> Result<()> {
    template_with(dir, shape, ws, dirty, false, false)
}

/// [`template`], plus fresh (not yet driven) virtio-net and/or virtio-vsock devices in the
/// shim's layout: restoring it measures rebinding their backends (tap, vsock socket, workers).
fn template_with(
    dir: &Path,
    shape: Shape,
    ws: u64,
    dirty: u64,
    net: bool,
    vsock: bool,
) -> Result<()> {
    let vmm = Vmm::new()?;
    let mut vm = vmm.create_vm(shape)?;
    vm.load_test_guest(test_guests::BENCH)?;
    vm.write_u64(test_guests::PARAMS_ADDR, ws)?;
    vm.write_u64(test_guests::PARAMS_ADDR + 8, dirty)?;
    vm.write_u64(test_guests::PARAMS_ADDR + 16, test_guests::DATA_ADDR + ws)?;
    let r = vm.run_until(Duration::from_secs(60))?;
    if r.outcome != RunOutcome::PausePoint(1) {
        bail!("template guest: {:?}", r.outcome);
    }
    let mut devices = DeviceStates::new();
    if net {
        let (dev_end, _) = std::os::unix::net::UnixDatagram::pair()?;
        let t = MmioTransport::new(
            Net::new(dev_end.into(), [0x02, 0xcb, 0, 0, 0, 1])?,
            vm.memory().clone(),
            IrqLine::new(devices::NET_GSI)?,
        )?;
        devices.insert(devices::NET_NAME.into(), serde_json::to_vec(&t.state())?);
    }
    if vsock {
        let t = MmioTransport::new(
            Vsock::new(3, &dir.with_extension("vsock"))?,
            vm.memory().clone(),
            IrqLine::new(devices::VSOCK_GSI)?,
        )?;
        devices.insert(devices::VSOCK_NAME.into(), serde_json::to_vec(&t.state())?);
    }
    vm.snapshot(dir, &devices)?;
    Ok(())
}

/// A persistent tap for the net restore samples (needs root); deleted on drop.
struct BenchTap(String);

impl BenchTap {
    fn create() -> Option<BenchTap> {
        let name = format!("csb{}", std::process::id() % 10_000_000);
        let ok = Command::new("ip")
            .args(["tuntap", "add", "dev", &name, "mode", "tap"])
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        ok.then_some(BenchTap(name))
    }
}

impl Drop for BenchTap {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", "dev", &self.0])
            .status();
    }
}

fn restore_op(dir: &Path) -> Op {
    Op::Restore {
        snapshot: dir.to_path_buf(),
        disk: None,
        tap: None,
        vsock: None,
    }
}

fn wait_pause_point(c: &mut Client, v: u32) -> Result<()> {
    match c.call(Op::Wait { timeout_ms: 60_000 })? {
        Reply::Guest {
            guest: GuestStatus::PausePoint { value },
            ..
        } if value == v => Ok(()),
        other => bail!("guest did not reach pause point {v}: {other:?}"),
    }
}

fn stats(c: &mut Client) -> Result<Stats> {
    match c.call(Op::Stats)? {
        Reply::Stats { stats, .. } => Ok(stats),
        other => bail!("stats: {other:?}"),
    }
}

fn pct(sorted: &[f64], p: usize) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) * p + 50) / 100]
}

struct Row {
    name: String,
    unit: &'static str,
    p50: f64,
    p90: f64,
    p99: f64,
    target: Option<f64>,
    samples: usize,
}

impl Row {
    fn new(name: &str, unit: &'static str, mut v: Vec<f64>, target: Option<f64>) -> Row {
        v.sort_by(|a, b| a.total_cmp(b));
        Row {
            name: name.into(),
            unit,
            p50: pct(&v, 50),
            p90: pct(&v, 90),
            p99: pct(&v, 99),
            target,
            samples: v.len(),
        }
    }
    fn pass(&self) -> Option<bool> {
        self.target.map(|t| self.p50 <= t)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let bin = match &cli.shim {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("binary directory")?
            .join("cube-shim"),
    };
    if !bin.exists() {
        bail!(
            "{} not found (build cube-shim, or pass --shim)",
            bin.display()
        );
    }
    let out = cli.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from(format!("benches/results/shim-bench-{t}"))
    });
    std::fs::create_dir_all(&out)?;
    let shape = Shape::new(1, cli.mem_mib);
    let ws = cli.working_set_mib << 20;
    let tdir = tempfile::Builder::new()
        .prefix("shim-bench-tpl-")
        .tempdir_in("/dev/shm")?;
    let idle_tpl = tdir.path().join("idle");
    let dirty_tpl = tdir.path().join("dirty");
    template(&idle_tpl, shape, ws, 0)?;
    template(&dirty_tpl, shape, ws, cli.dirty_mib << 20)?;
    let mut rows = Vec::new();

    // 1. Restore latency into pre-spawned shims.
    let mut reply_ms = Vec::new();
    let mut running_ms = Vec::new();
    let mut server_us = Vec::new();
    for _ in 0..cli.iterations {
        let shim = ShimProc::spawn(&bin, shape)?;
        let mut c = shim.client()?;
        c.call(Op::Ping)?; // connection warm, as cubelet's would be
        let t0 = Instant::now();
        let r = c.call(restore_op(&idle_tpl))?;
        let t1 = t0.elapsed();
        // The guest's first instruction after the restore is a checkpoint, then pause point 3.
        wait_pause_point(&mut c, 3)?;
        let t2 = t0.elapsed();
        if let Reply::Restored { restore_us } = r {
            server_us.push(restore_us as f64 / 1000.0);
        }
        reply_ms.push(ms(t1));
        running_ms.push(ms(t2));
    }
    rows.push(Row::new(
        "restore request → reply (guest resumed)",
        "ms",
        reply_ms,
        Some(2.0),
    ));
    // Same, into shims started with --template (shell bound to the template ahead of time).
    let mut prepared_ms = Vec::new();
    for _ in 0..cli.iterations {
        let shim =
            ShimProc::spawn_with(&bin, shape, &["--template".as_ref(), idle_tpl.as_os_str()])?;
        let mut c = shim.client()?;
        c.call(Op::Ping)?;
        let t0 = Instant::now();
        c.call(restore_op(&idle_tpl))?;
        prepared_ms.push(ms(t0.elapsed()));
        wait_pause_point(&mut c, 3)?;
    }
    rows.push(Row::new(
        "restore request → reply, shim started with --template",
        "ms",
        prepared_ms,
        Some(2.0),
    ));
    rows.push(Row::new(
        "restore request → guest ran to its first pause point",
        "ms",
        running_ms,
        None,
    ));
    rows.push(Row::new(
        "restore inside the shim (server side)",
        "ms",
        server_us,
        None,
    ));

    // Same, from a template with virtio-net (when a tap can be made) and virtio-vsock devices:
    // the shim opens the tap, binds the vsock socket and starts a backend worker for each.
    let tap = BenchTap::create();
    let dev_tpl = tdir.path().join("devices");
    template_with(&dev_tpl, shape, ws, 0, tap.is_some(), true)?;
    let mut dev_ms = Vec::new();
    for i in 0..cli.iterations {
        let shim = ShimProc::spawn(&bin, shape)?;
        let mut c = shim.client()?;
        c.call(Op::Ping)?;
        let t0 = Instant::now();
        c.call(Op::Restore {
            snapshot: dev_tpl.clone(),
            disk: None,
            tap: tap.as_ref().map(|t| t.0.clone()),
            vsock: Some(tdir.path().join(format!("v{i}.sock"))),
        })?;
        dev_ms.push(ms(t0.elapsed()));
        wait_pause_point(&mut c, 3)?;
    }
    rows.push(Row::new(
        if tap.is_some() {
            "restore request → reply, with virtio-net (tap) + virtio-vsock"
        } else {
            "restore request → reply, with virtio-vsock (no tap: not root)"
        },
        "ms",
        dev_ms,
        Some(2.0),
    ));
    drop(tap);

    // 2. Memory per idle shim, N shims from one template.
    let mut shims = Vec::new();
    for _ in 0..cli.shims {
        let s = ShimProc::spawn(&bin, shape)?;
        let mut c = s.client()?;
        c.call(restore_op(&idle_tpl))?;
        wait_pause_point(&mut c, 3)?;
        shims.push((s, c));
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut beyond = Vec::new();
    let mut pss = Vec::new();
    for (_, c) in shims.iter_mut() {
        let s = stats(c)?;
        // Private memory beyond the guest pages the shim wrote (copy-on-write copies).
        beyond.push(s.process_private_kib.saturating_sub(s.guest_anon_kib) as f64 / 1024.0);
        pss.push(s.process_pss_kib as f64 / 1024.0);
    }
    rows.push(Row::new(
        &format!(
            "private memory per idle shim beyond written pages ({} shims)",
            cli.shims
        ),
        "MiB",
        beyond,
        Some(8.0),
    ));
    rows.push(Row::new(
        &format!(
            "PSS per idle shim ({} shims, {} MiB template)",
            cli.shims, cli.mem_mib
        ),
        "MiB",
        pss,
        None,
    ));
    drop(shims);

    // 3. Pause to disk (guest dirtied `dirty_mib`) and resume in a new shim.
    let mut p2d = Vec::new();
    let mut resume = Vec::new();
    for _ in 0..5 {
        let a = ShimProc::spawn(&bin, shape)?;
        let mut ca = a.client()?;
        ca.call(restore_op(&dirty_tpl))?;
        wait_pause_point(&mut ca, 3)?;
        let pdir = tempfile::Builder::new()
            .prefix("shim-bench-p2d-")
            .tempdir_in("/dev/shm")?;
        let t0 = Instant::now();
        ca.call(Op::PauseToDisk {
            dir: pdir.path().to_path_buf(),
        })?;
        p2d.push(ms(t0.elapsed()));
        drop(a);
        let b = ShimProc::spawn(&bin, shape)?;
        let mut cb = b.client()?;
        let t0 = Instant::now();
        cb.call(Op::Resume {
            dir: Some(pdir.path().to_path_buf()),
            disk: None,
            tap: None,
            vsock: None,
        })?;
        resume.push(ms(t0.elapsed()));
        // Resumed after pause point 3: the guest reports done 0.
        match cb.call(Op::Wait { timeout_ms: 60_000 })? {
            Reply::Guest {
                guest: GuestStatus::Done { code: 0 },
                ..
            } => {}
            other => bail!("resumed guest: {other:?}"),
        }
    }
    rows.push(Row::new(
        &format!("pause_to_disk ({} MiB dirtied)", cli.dirty_mib),
        "ms",
        p2d,
        None,
    ));
    rows.push(Row::new(
        "resume from pause-to-disk in a new shim",
        "ms",
        resume,
        None,
    ));

    println!("| metric | p50 | p90 | p99 | unit | samples | target | pass |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {} | {} | {} | {} |",
            r.name,
            r.p50,
            r.p90,
            r.p99,
            r.unit,
            r.samples,
            r.target
                .map(|t| format!("≤ {t}"))
                .unwrap_or_else(|| "-".into()),
            match r.pass() {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            }
        );
    }
    let json = serde_json::json!({
        "bench": "shim-bench",
        "mem_mib": cli.mem_mib,
        "working_set_mib": cli.working_set_mib,
        "shims": cli.shims,
        "metrics": rows.iter().map(|r| serde_json::json!({
            "name": r.name, "unit": r.unit, "p50": r.p50, "p90": r.p90, "p99": r.p99,
            "samples": r.samples, "target_p50": r.target, "pass": r.pass(),
        })).collect::<Vec<_>>(),
    });
    let path = out.join("shim-bench.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&json)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
