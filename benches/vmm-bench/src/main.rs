//! `vmm-bench --out DIR`: restore latency into pre-created shells (512 MiB and 2 GiB guests),
//! cold restore, pause-to-disk of a 2 GiB guest that dirtied 64 MiB and resume from it, and the
//! VMM's memory overhead (PSS beyond guest pages). Snapshot files live in /dev/shm (page cache).
//! Prints a markdown table with targets and pass/fail, writes `vmm-bench.json` to DIR.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use cube_hypervisor::{
    restore, restore_into, test_guests, RunOutcome, Shape, Snapshot, VcpuEvent, Vm, VmShell, Vmm,
};

#[derive(Parser)]
#[command(name = "vmm-bench")]
struct Cli {
    /// Output directory (default benches/results/vmm-bench-<unix time>/).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Samples per latency metric.
    #[arg(long, default_value_t = 40)]
    iterations: usize,
    /// Template working set the guest touches before the snapshot, MiB.
    #[arg(long, default_value_t = 16)]
    working_set_mib: u64,
    #[command(subcommand)]
    child: Option<Child>,
}

#[derive(Subcommand)]
enum Child {
    /// (internal) restore the snapshot in DIR, run to the first instruction, report PSS.
    PssChild { dir: PathBuf },
}

const TIMEOUT: Duration = Duration::from_secs(60);
const DIRTY_MIB: u64 = 64;

struct Metric {
    name: String,
    samples_ms: Vec<f64>,
    target_ms: Option<f64>,
    unit: &'static str,
}

fn pct(sorted: &[f64], p: usize) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) * p + 50) / 100]
}

impl Metric {
    fn new(name: impl Into<String>, samples_ms: Vec<f64>, target_ms: Option<f64>) -> Self {
        Metric {
            name: name.into(),
            samples_ms,
            target_ms,
            unit: "ms",
        }
    }
    fn stats(&self) -> (f64, f64, f64) {
        let mut s = self.samples_ms.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        (pct(&s, 50), pct(&s, 90), pct(&s, 99))
    }
    fn min(&self) -> f64 {
        self.samples_ms
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
    }
    fn pass(&self) -> Option<bool> {
        self.target_ms.map(|t| self.stats().0 <= t)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn wait_for(vm: &Vm, want: &VcpuEvent) -> Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match vm.next_event(deadline.saturating_duration_since(Instant::now()))? {
            Some((_, ev)) if &ev == want => return Ok(()),
            Some((id, VcpuEvent::Error(e))) => bail!("vCPU {id}: {e}"),
            Some(_) => {}
            None => bail!("timed out waiting for {want:?}"),
        }
    }
}

/// Boots the bench guest, lets it touch its working set, snapshots it at pause point 1.
fn make_template(vmm: &Vmm, dir: &Path, mem_mib: u32, ws_mib: u64) -> Result<()> {
    let mut vm = vmm.create_vm(Shape::new(1, mem_mib))?;
    vm.load_test_guest(test_guests::BENCH)?;
    vm.write_u64(test_guests::PARAMS_ADDR, ws_mib << 20)?;
    let r = vm.run_until(TIMEOUT)?;
    if r.outcome != RunOutcome::PausePoint(1) {
        bail!("bench guest stopped with {:?}", r.outcome);
    }
    vm.snapshot(dir, &BTreeMap::new())?;
    // tmpfs files are memory; elsewhere read the file once so it is in the page cache.
    if !dir.starts_with("/dev/shm") {
        let mut f = std::fs::File::open(dir.join("memory.img")).context("open memory.img")?;
        let mut buf = vec![0u8; 1 << 20];
        while std::io::Read::read(&mut f, &mut buf).context("read memory.img")? > 0 {}
    }
    Ok(())
}

/// Restores into pre-created shells (created in batches, untimed); times restore_into alone
/// and restore_into + resume until the guest's first instruction reports.
fn shell_restores(
    vmm: &Vmm,
    snap: &Snapshot,
    n: usize,
    first: &VcpuEvent,
    prepare: bool,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut restore_ms = Vec::new();
    let mut first_ms = Vec::new();
    let batch = 8;
    let mut done = 0;
    while done < n {
        let shells: Vec<VmShell> = (0..batch.min(n - done))
            .map(|_| {
                let mut s = VmShell::new(vmm, snap.shape())?;
                if prepare {
                    s.prepare(snap)?;
                }
                Ok(s)
            })
            .collect::<cube_hypervisor::Result<_>>()?;
        for shell in shells {
            let t0 = Instant::now();
            let mut vm = restore_into(shell, snap)?;
            let t1 = Instant::now();
            vm.resume()?;
            wait_for(&vm, first)?;
            let t2 = Instant::now();
            restore_ms.push(ms(t1 - t0));
            first_ms.push(ms(t2 - t0));
            vm.pause()?;
            done += 1;
        }
    }
    Ok((restore_ms, first_ms))
}

/// Cold restores: open the snapshot, create the VM, restore, run to the first instruction.
fn cold_restores(vmm: &Vmm, dir: &Path, n: usize, first: &VcpuEvent) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        let snap = Snapshot::open(dir)?;
        let mut vm = restore(vmm, &snap)?;
        vm.resume()?;
        wait_for(&vm, first)?;
        out.push(ms(t0.elapsed()));
        vm.pause()?;
    }
    Ok(out)
}

fn pss_child(dir: &Path) -> Result<()> {
    let vmm = Vmm::new()?;
    let snap = Snapshot::open(dir)?;
    let mut vm = restore(&vmm, &snap)?;
    vm.resume()?;
    wait_for(&vm, &VcpuEvent::Checkpoint(2))?;
    vm.pause()?;
    let range = vm.host_ram_range();
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let (mut total_kb, mut guest_kb, mut rss_kb) = (0u64, 0u64, 0u64);
    let mut in_guest = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                in_guest = a >= range.start && b <= range.end;
                continue;
            }
        }
        let kb = |l: &str| {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        if line.starts_with("Pss:") {
            total_kb += kb(line);
            if in_guest {
                guest_kb += kb(line);
            }
        } else if line.starts_with("Rss:") {
            rss_kb += kb(line);
        }
    }
    println!(
        "{}",
        serde_json::json!({"pss_kb": total_kb, "guest_pss_kb": guest_kb, "rss_kb": rss_kb,
                           "overhead_kb": total_kb - guest_kb})
    );
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(Child::PssChild { dir }) = &cli.child {
        return pss_child(dir);
    }
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let out = cli
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("benches/results/vmm-bench-{unix}")));
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    let work = tempfile::Builder::new()
        .prefix("cube-vmm-bench-")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())?;
    let vmm = Vmm::new().context("this benchmark needs /dev/kvm")?;
    let n = cli.iterations.max(1);
    let first = VcpuEvent::Checkpoint(2);
    let mut metrics = Vec::new();

    for mem in [512u32, 2048] {
        let dir = work.path().join(format!("tpl-{mem}"));
        let t = Instant::now();
        make_template(&vmm, &dir, mem, cli.working_set_mib)?;
        eprintln!("template {mem} MiB: snapshot in {:.0} ms", ms(t.elapsed()));
        let snap = Snapshot::open(&dir)?;
        let (restore_ms, first_ms) = shell_restores(&vmm, &snap, n, &first, false)?;
        metrics.push(Metric::new(
            format!("shell restore_into (mmap file + set state), {mem} MiB"),
            restore_ms,
            None,
        ));
        metrics.push(Metric::new(
            format!("shell restore → first guest instruction, {mem} MiB"),
            first_ms,
            Some(1.0),
        ));
        let (restore_ms, first_ms) = shell_restores(&vmm, &snap, n, &first, true)?;
        metrics.push(Metric::new(
            format!("template-prepared shell restore_into (set state), {mem} MiB"),
            restore_ms,
            None,
        ));
        metrics.push(Metric::new(
            format!("template-prepared shell restore → first guest instruction, {mem} MiB"),
            first_ms,
            Some(1.0),
        ));
        let cold = cold_restores(&vmm, &dir, n.min(20), &first)?;
        metrics.push(Metric::new(
            format!("cold restore (open + create VM) → first instruction, {mem} MiB"),
            cold,
            Some(10.0),
        ));
    }

    // Pause to disk: a 2 GiB guest restored from the template dirties 64 MiB.
    let tpl = work.path().join("tpl-2048");
    let snap = Snapshot::open(&tpl)?;
    let mut p2d_ms = Vec::new();
    let mut p2d_pages = 0u64;
    let p2d_dir = work.path().join("paused");
    for i in 0..5 {
        let mut vm = restore_into(VmShell::new(&vmm, snap.shape())?, &snap)?;
        vm.write_u64(test_guests::PARAMS_ADDR + 8, DIRTY_MIB << 20)?;
        vm.write_u64(test_guests::PARAMS_ADDR + 16, 256 << 20)?;
        let r = vm.run_until(TIMEOUT)?;
        if r.outcome != RunOutcome::PausePoint(3) {
            bail!("bench guest phase B ended with {:?}", r.outcome);
        }
        let dir = if i == 4 {
            p2d_dir.clone()
        } else {
            work.path().join(format!("paused-{i}"))
        };
        let t0 = Instant::now();
        let m = vm.pause_to_disk(&dir, &BTreeMap::new())?;
        p2d_ms.push(ms(t0.elapsed()));
        if let cube_hypervisor::snapshot::MemoryRef::Diff { runs, .. } = &m.memory {
            p2d_pages = runs.iter().map(|r| r.1).sum();
        }
        if i != 4 {
            std::fs::remove_dir_all(&dir)?;
        }
    }
    metrics.push(Metric::new(
        format!("pause-to-disk, 2 GiB guest, {DIRTY_MIB} MiB dirtied ({p2d_pages} pages written)"),
        p2d_ms,
        Some(150.0),
    ));
    let done = VcpuEvent::Done(0);
    let psnap = Snapshot::open(&p2d_dir)?;
    let (_, resume_ms) = shell_restores(&vmm, &psnap, n, &done, false)?;
    metrics.push(Metric::new(
        "resume from pause-to-disk into a shell → first instruction, 2 GiB",
        resume_ms,
        Some(5.0),
    ));
    let cold = cold_restores(&vmm, &p2d_dir, n.min(20), &done)?;
    metrics.push(Metric::new(
        "resume from pause-to-disk, cold → first instruction, 2 GiB",
        cold,
        None,
    ));

    // VMM overhead in a fresh process restored from the 512 MiB template.
    let exe = std::env::current_exe()?;
    let o = std::process::Command::new(exe)
        .args(["pss-child"])
        .arg(work.path().join("tpl-512"))
        .output()?;
    if !o.status.success() {
        bail!("pss child failed: {}", String::from_utf8_lossy(&o.stderr));
    }
    let pss: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let overhead_mib = pss["overhead_kb"].as_u64().unwrap_or(0) as f64 / 1024.0;
    let mut pss_metric = Metric::new(
        "VMM overhead: PSS beyond guest pages (1 vCPU, 512 MiB)",
        vec![overhead_mib],
        Some(5.0),
    );
    pss_metric.unit = "MiB";
    metrics.push(pss_metric);

    println!("| metric | n | min | p50 | p90 | p99 | target (p50) | result |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for m in &metrics {
        let (p50, p90, p99) = m.stats();
        let target = m
            .target_ms
            .map(|t| format!("≤ {t} {}", m.unit))
            .unwrap_or_else(|| "—".into());
        let result = match m.pass() {
            Some(true) => "pass",
            Some(false) => "FAIL",
            None => "info",
        };
        println!(
            "| {} | {} | {min:.3} {u} | {p50:.3} {u} | {p90:.3} {u} | {p99:.3} {u} | {target} | {result} |",
            m.name,
            m.samples_ms.len(),
            min = m.min(),
            u = m.unit
        );
        json.push(serde_json::json!({
            "metric": m.name, "unit": m.unit, "n": m.samples_ms.len(),
            "min": m.min(), "p50": p50, "p90": p90, "p99": p99, "target_p50": m.target_ms, "pass": m.pass(),
        }));
    }
    let report = serde_json::json!({
        "bench": "vmm-bench",
        "unix_time": unix,
        "pvm_host": vmm.is_pvm(),
        "working_set_mib": cli.working_set_mib,
        "pss_child": pss,
        "metrics": json,
    });
    let path = out.join("vmm-bench.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
