//! The standard suite against a running Cube. Each phase runs `c` workers, each with its own
//! kept-alive connections, pulling jobs from a shared counter until the phase's total is done.

use crate::api::{ApiError, Client, Sandbox, Settings};
use crate::machine;
use crate::report::{DensityRow, LatencyRow, LifecycleRow, OpResult, Section, ThroughputRow};
use crate::stats::summarize;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const CLOCK_CREATE: &str = "starts just before `POST /v2/sandboxes` is written to a kept-alive connection, stops when the 201 body is read (the server returns only when the sandbox's agent answers); the DELETE that follows each create is outside the clock";
pub const CLOCK_FIRST_CMD: &str = "starts just before `POST /v2/sandboxes`, stops when the `process.Process/Start` stream of `/bin/bash -l -c \"echo hi\"` through the edge has ended with stdout \"hi\\n\" and exit 0 (what `Sandbox.create()` + `commands.run(\"echo hi\")` costs an SDK user, minus SDK overhead)";
pub const CLOCK_THROUGHPUT: &str = "wall time from the first request of the phase to the last worker finishing; create-delete: each worker loops create then delete (deletes inside the wall time), create-only: creates only, sandboxes deleted afterwards outside the clock; creates/s = successful creates / wall time";
pub const CLOCK_DENSITY: &str = "host `MemAvailable` (/proc/meminfo) read after a settle time with no bench sandboxes, then after each cumulative step of idle sandboxes; MiB per sandbox = (before − after) / live sandboxes (CubeSandbox's method); includes everything the host spends per sandbox (agent, shim/VMM, page tables, cgroups, switch state)";
pub const CLOCK_PAUSE: &str = "pause: `POST /sandboxes/{id}/pause` sent → 204 read; resume: `POST /v2/sandboxes/{id}/connect` sent → 201 read (returns when the agent answers; an `echo hi` afterwards checks it, outside the clock); dirty memory = N MiB of random bytes written by a command into /dev/shm (or /tmp) in the sandbox before pausing";
pub const CLOCK_SNAPSHOT: &str = "snapshot: `POST /sandboxes/{id}/snapshots` sent → 201 read; clone: `POST /v2/sandboxes` with the snapshot id as template sent → 201 read; fork: `POST /sandboxes/{id}/fork` (count 1) sent → 201 read; dirty memory written as for pause";

#[derive(Debug, Clone)]
pub struct Plan {
    pub concurrency: Vec<usize>,
    /// Measured samples per concurrency (at least `min_rounds` × concurrency).
    pub samples: usize,
    pub min_rounds: usize,
    /// Warm-up rounds (× concurrency attempts) before each measured phase, discarded.
    pub warmup_rounds: usize,
    /// Most sandboxes the create-only phase keeps alive at once.
    pub max_live: usize,
    /// Density steps (cumulative live sandboxes); empty = density skipped.
    pub density_levels: Vec<usize>,
    pub density_skip_reason: Option<String>,
    pub settle: Duration,
    pub dirty_mib: Vec<u64>,
    pub lifecycle_reps: usize,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    CreateDelete,
    CreateOnly,
    FirstCommand,
}

#[derive(Default)]
struct Outcome {
    samples: Vec<f64>,
    failures: usize,
    errors: Vec<String>,
    created: Vec<String>,
    wall: Duration,
}

fn note_error(errors: &mut Vec<String>, e: String) {
    if errors.len() < 5 && !errors.contains(&e) {
        errors.push(e);
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub fn bar(total: usize, prefix: &str) -> ProgressBar {
    let pb = ProgressBar::new(total as u64);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>34} [{bar:30.cyan/blue}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_prefix(prefix.to_string());
    pb
}

async fn one_job(c: &mut Client, kind: Kind) -> (Result<f64, String>, Option<String>) {
    let template = c.s.template.clone();
    let t0 = Instant::now();
    let sb = match c.create(&template).await {
        Ok(sb) => sb,
        Err(e) => return (Err(e.to_string()), None),
    };
    match kind {
        Kind::CreateOnly => (Ok(ms(t0.elapsed())), Some(sb.id)),
        Kind::CreateDelete => {
            let t = ms(t0.elapsed());
            match c.kill(&sb.id).await {
                Ok(()) => (Ok(t), None),
                // The sample stands; the sandbox is left to the caller's cleanup.
                Err(e) => (Err(format!("delete after create: {e}")), Some(sb.id)),
            }
        }
        Kind::FirstCommand => {
            let r = c.run(&sb, "echo hi").await;
            let t = ms(t0.elapsed());
            let r = match r {
                Ok(o) if o.stdout == "hi\n" && o.exit_code == 0 => Ok(t),
                Ok(o) => Err(format!("echo hi printed {:?}", o.stdout)),
                Err(e) => Err(e.to_string()),
            };
            let left = c.kill(&sb.id).await.err().map(|_| sb.id);
            (r, left)
        }
    }
}

/// Runs `total` jobs of `kind` on `conc` workers.
async fn run_jobs(
    s: &Settings,
    kind: Kind,
    conc: usize,
    total: usize,
    pb: &ProgressBar,
) -> Outcome {
    let next = Arc::new(AtomicUsize::new(0));
    let out = Arc::new(Mutex::new(Outcome::default()));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..conc.max(1) {
        let (next, out, pb, s) = (next.clone(), out.clone(), pb.clone(), s.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = Client::new(s);
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let (r, left) = one_job(&mut c, kind).await;
                let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
                match r {
                    Ok(t) => o.samples.push(t),
                    Err(e) => {
                        o.failures += 1;
                        note_error(&mut o.errors, e);
                    }
                }
                o.created.extend(left);
                drop(o);
                pb.inc(1);
            }
        }));
    }
    for t in tasks {
        if let Err(e) = t.await {
            let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
            note_error(&mut o.errors, format!("worker panicked: {e}"));
        }
    }
    let mut o = std::mem::take(&mut *out.lock().unwrap_or_else(|p| p.into_inner()));
    o.wall = start.elapsed();
    o
}

/// Deletes sandboxes concurrently; returns the errors.
pub async fn kill_all(s: &Settings, ids: Vec<String>, conc: usize) -> Vec<String> {
    let ids = Arc::new(Mutex::new(ids));
    let errs = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..conc.max(1) {
        let (ids, errs, s) = (ids.clone(), errs.clone(), s.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = Client::new(s);
            loop {
                let id = ids.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let Some(id) = id else { break };
                if let Err(e) = c.kill(&id).await {
                    let mut v = errs.lock().unwrap_or_else(|p| p.into_inner());
                    note_error(&mut v, format!("{id}: {e}"));
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let v = errs.lock().unwrap_or_else(|p| p.into_inner()).clone();
    v
}

fn latency_row(conc: usize, warmup: usize, o: &Outcome) -> LatencyRow {
    LatencyRow {
        concurrency: conc,
        warmup,
        attempts: o.samples.len() + o.failures,
        failures: o.failures,
        summary: summarize(&o.samples, o.failures),
        errors: o.errors.clone(),
        samples_ms: o
            .samples
            .iter()
            .map(|v| (v * 1000.0).round() / 1000.0)
            .collect(),
    }
}

fn throughput_row(conc: usize, mode: &str, o: &Outcome) -> ThroughputRow {
    let wall = o.wall.as_secs_f64();
    ThroughputRow {
        concurrency: conc,
        mode: mode.into(),
        attempts: o.samples.len() + o.failures,
        ok: o.samples.len(),
        failures: o.failures,
        wall_s: wall,
        creates_per_s: if wall > 0.0 {
            o.samples.len() as f64 / wall
        } else {
            0.0
        },
        errors: o.errors.clone(),
    }
}

pub struct Results {
    pub create_latency: Section<LatencyRow>,
    pub first_command: Section<LatencyRow>,
    pub throughput: Section<ThroughputRow>,
}

/// Create latency, create-delete and create-only throughput, create → first command, per concurrency.
pub async fn latency_and_throughput(s: &Settings, p: &Plan) -> Results {
    let mut cl = Section::new(CLOCK_CREATE);
    let mut fc = Section::new(CLOCK_FIRST_CMD);
    let mut tp = Section::new(CLOCK_THROUGHPUT);
    let mut leftovers = Vec::new();
    for &c in &p.concurrency {
        let n = p.samples.max(p.min_rounds * c);
        let warm = p.warmup_rounds * c;
        let total = warm + n + n.min(p.max_live).max(c) + warm + n;
        let pb = bar(total, &format!("c={c}: create latency"));
        let w = run_jobs(s, Kind::CreateDelete, c, warm, &pb).await;
        leftovers.extend(w.created);
        let o = run_jobs(s, Kind::CreateDelete, c, n, &pb).await;
        leftovers.extend(o.created.iter().cloned());
        cl.rows.push(latency_row(c, warm, &o));
        tp.rows.push(throughput_row(c, "create-delete", &o));

        pb.set_prefix(format!("c={c}: create-only throughput"));
        let o = run_jobs(s, Kind::CreateOnly, c, n.min(p.max_live).max(c), &pb).await;
        tp.rows.push(throughput_row(c, "create-only", &o));
        let errs = kill_all(s, o.created, c.max(4)).await;
        if let Some(e) = errs.first() {
            // suspend, not println: println is dropped when stderr is not a terminal.
            pb.suspend(|| eprintln!("warning: deleting create-only sandboxes: {e}"));
        }

        pb.set_prefix(format!("c={c}: create → echo hi"));
        let w = run_jobs(s, Kind::FirstCommand, c, warm, &pb).await;
        leftovers.extend(w.created);
        let o = run_jobs(s, Kind::FirstCommand, c, n, &pb).await;
        leftovers.extend(o.created.iter().cloned());
        fc.rows.push(latency_row(c, warm, &o));
        pb.finish_and_clear();
        let (a, b) = (&cl.rows[cl.rows.len() - 1], &fc.rows[fc.rows.len() - 1]);
        eprintln!(
            "c={c:<3} create p50 {} ms p99 {} ms ({} failed) | create→echo p50 {} ms ({} failed) | {:.1} creates/s",
            a.summary.as_ref().map(|s| format!("{:.1}", s.p50_ms)).unwrap_or("–".into()),
            a.summary.as_ref().map(|s| format!("{:.1}", s.p99_ms)).unwrap_or("–".into()),
            a.failures,
            b.summary.as_ref().map(|s| format!("{:.1}", s.p50_ms)).unwrap_or("–".into()),
            b.failures,
            tp.rows[tp.rows.len() - 2].creates_per_s,
        );
    }
    if !leftovers.is_empty() {
        kill_all(s, leftovers, 4).await;
    }
    Results {
        create_latency: cl,
        first_command: fc,
        throughput: tp,
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Host memory per idle sandbox at cumulative steps of live sandboxes.
pub async fn density(s: &Settings, p: &Plan) -> Section<DensityRow> {
    if let Some(r) = &p.density_skip_reason {
        return Section::unavailable(CLOCK_DENSITY, r.clone());
    }
    let mut sec = Section::new(CLOCK_DENSITY);
    let total_kib = machine::meminfo_kib(
        &std::fs::read_to_string("/proc/meminfo").unwrap_or_default(),
        "MemTotal",
    )
    .unwrap_or(0);
    tokio::time::sleep(p.settle).await;
    let Some(before) = machine::mem_available_kib() else {
        return Section::unavailable(CLOCK_DENSITY, "cannot read /proc/meminfo".into());
    };
    let max = p.density_levels.iter().copied().max().unwrap_or(0);
    let pb = bar(max, "density: idle sandboxes");
    let mut live: Vec<String> = Vec::new();
    for &level in &p.density_levels {
        let need = level.saturating_sub(live.len());
        let o = run_jobs(s, Kind::CreateOnly, 10.min(need.max(1)), need, &pb).await;
        live.extend(o.created);
        tokio::time::sleep(p.settle).await;
        let after = machine::mem_available_kib().unwrap_or(before);
        // Signed: a negative drop means something else on the host freed memory meanwhile, and
        // the reader must see that rather than a clamped zero.
        let delta = mib(before) - mib(after);
        let n = live.len();
        let mut errors = o.errors.clone();
        if delta < 0.0 {
            note_error(
                &mut errors,
                "MemAvailable rose during this step: other processes changed their memory use; measure density on a quiet host".into(),
            );
        }
        let low = total_kib > 0 && after < total_kib / 8;
        if low {
            note_error(
                &mut errors,
                "stopped: MemAvailable below 1/8 of MemTotal".into(),
            );
        }
        sec.rows.push(DensityRow {
            target: level,
            live: n,
            mem_available_before_mib: mib(before),
            mem_available_after_mib: mib(after),
            delta_mib: delta,
            per_sandbox_mib: if n > 0 { delta / n as f64 } else { f64::NAN },
            errors,
        });
        pb.suspend(|| {
            eprintln!(
                "density: {n} live sandboxes, MemAvailable drop {delta:.0} MiB, {:.1} MiB each",
                if n > 0 { delta / n as f64 } else { f64::NAN }
            )
        });
        if o.failures > 0 || low {
            sec.reason = Some(format!(
                "stopped at {n} live sandboxes of {level}: {}",
                o.errors
                    .first()
                    .cloned()
                    .unwrap_or_else(|| "host memory low".into())
            ));
            break;
        }
    }
    pb.finish_and_clear();
    let errs = kill_all(s, live, 10).await;
    if let Some(e) = errs.first() {
        eprintln!("warning: deleting density sandboxes: {e}");
    }
    sec
}

/// An operation the server does not offer: the route is missing (404/405) or not implemented (501).
fn unavailable(e: &ApiError) -> bool {
    matches!(e.status(), Some(404 | 405 | 501))
}

#[derive(Default)]
struct Op {
    unavailable: Option<String>,
    samples: Vec<f64>,
    failures: usize,
    errors: Vec<String>,
}

impl Op {
    /// Records a call that took `t` ms (read right after it returned).
    fn record<T>(&mut self, t: f64, r: &Result<T, ApiError>) {
        match r {
            Ok(_) => self.samples.push(t),
            // Not offered by the server: reported as such, not as a failure.
            Err(e) if unavailable(e) => {
                self.unavailable.get_or_insert_with(|| e.to_string());
            }
            Err(e) => {
                self.failures += 1;
                note_error(&mut self.errors, e.to_string());
            }
        }
    }

    fn fail(&mut self, e: String) {
        self.failures += 1;
        note_error(&mut self.errors, e);
    }

    fn result(self) -> OpResult {
        OpResult {
            unavailable: self.unavailable,
            attempts: self.samples.len() + self.failures,
            failures: self.failures,
            summary: summarize(&self.samples, self.failures),
            errors: self.errors,
            samples_ms: self.samples,
        }
    }
}

fn dirty_cmd(mib: u64) -> String {
    // Random bytes, so neither the guest nor a zero-page-aware snapshot can skip them.
    format!(
        "d=/dev/shm; [ -d $d ] && [ -w $d ] || d=/tmp; head -c {} /dev/urandom > $d/cube-bench-dirty",
        mib * 1024 * 1024
    )
}

/// One create + dirty-memory sandbox per repetition: pause, resume, snapshot, clone, fork.
pub async fn lifecycle(s: &Settings, p: &Plan) -> (Section<LifecycleRow>, Section<LifecycleRow>) {
    let mut pr = Section::new(CLOCK_PAUSE);
    let mut sc = Section::new(CLOCK_SNAPSHOT);
    let pb = bar(
        p.dirty_mib.len() * p.lifecycle_reps,
        "pause/resume/snapshot",
    );
    let mut c = Client::new(s.clone());
    let template = s.template.clone();
    // Stop asking for a route the server has shown it lacks.
    let (mut no_snapshot, mut no_fork) = (None::<String>, None::<String>);
    for &d in &p.dirty_mib {
        let (mut pause, mut resume) = (Op::default(), Op::default());
        let (mut snap, mut clone, mut fork) = (Op::default(), Op::default(), Op::default());
        for _ in 0..p.lifecycle_reps {
            pb.inc(1);
            let sb = match c.create(&template).await {
                Ok(sb) => sb,
                Err(e) => {
                    for o in [&mut pause, &mut resume, &mut snap, &mut clone, &mut fork] {
                        o.fail(format!("setup create: {e}"));
                    }
                    continue;
                }
            };
            let mut extra: Vec<String> = Vec::new();
            let setup = if d > 0 {
                c.run(&sb, &dirty_cmd(d)).await.map(|_| ())
            } else {
                Ok(())
            };
            if let Err(e) = setup {
                for o in [&mut pause, &mut resume, &mut snap, &mut clone, &mut fork] {
                    o.fail(format!("writing {d} MiB: {e}"));
                }
                let _ = c.kill(&sb.id).await;
                continue;
            }
            // Pause then resume.
            let t0 = Instant::now();
            let r = c.pause(&sb.id).await;
            pause.record(ms(t0.elapsed()), &r);
            if r.is_ok() {
                let t0 = Instant::now();
                let r = c.connect(&sb.id).await;
                let t = ms(t0.elapsed());
                match &r {
                    Ok(resumed) => match c.run(resumed, "echo hi").await {
                        Ok(o) if o.stdout == "hi\n" => resume.record(t, &r),
                        Ok(o) => {
                            resume.fail(format!("after resume echo hi printed {:?}", o.stdout))
                        }
                        Err(e) => resume.fail(format!("after resume: {e}")),
                    },
                    Err(_) => resume.record(t, &r),
                }
            } else {
                resume.fail("not attempted: pause failed".into());
            }
            // Snapshot, clone from it, fork.
            match &no_snapshot {
                Some(u) => {
                    snap.unavailable.get_or_insert(u.clone());
                    clone
                        .unavailable
                        .get_or_insert(format!("needs snapshots: {u}"));
                }
                None => {
                    let t0 = Instant::now();
                    let r = c.snapshot(&sb.id).await;
                    snap.record(ms(t0.elapsed()), &r);
                    match r {
                        Ok(snap_id) => {
                            let t0 = Instant::now();
                            let r = c.create(&snap_id).await;
                            clone.record(ms(t0.elapsed()), &r);
                            if let Ok(cl) = r {
                                extra.push(cl.id);
                            }
                            let _ = c.delete_template(&snap_id).await;
                        }
                        Err(e) if unavailable(&e) => {
                            no_snapshot = Some(e.to_string());
                            clone
                                .unavailable
                                .get_or_insert(format!("needs snapshots: {e}"));
                        }
                        Err(_) => clone.fail("not attempted: snapshot failed".into()),
                    }
                }
            }
            match &no_fork {
                Some(u) => {
                    fork.unavailable.get_or_insert(u.clone());
                }
                None => {
                    let t0 = Instant::now();
                    let r: Result<Sandbox, ApiError> = c.fork(&sb.id).await;
                    fork.record(ms(t0.elapsed()), &r);
                    match r {
                        Ok(f) => extra.push(f.id),
                        Err(e) if unavailable(&e) => no_fork = Some(e.to_string()),
                        Err(_) => {}
                    }
                }
            }
            extra.push(sb.id);
            for id in extra {
                let _ = c.kill(&id).await;
            }
        }
        pr.rows.push(LifecycleRow {
            dirty_mib: d,
            ops: BTreeMap::from([
                ("pause".to_string(), pause.result()),
                ("resume".to_string(), resume.result()),
            ]),
        });
        sc.rows.push(LifecycleRow {
            dirty_mib: d,
            ops: BTreeMap::from([
                ("snapshot".to_string(), snap.result()),
                ("clone".to_string(), clone.result()),
                ("fork".to_string(), fork.result()),
            ]),
        });
    }
    pb.finish_and_clear();
    mark_unavailable(&mut pr);
    mark_unavailable(&mut sc);
    (pr, sc)
}

/// A section whose every operation was unavailable is itself "not available", with the reason.
fn mark_unavailable(sec: &mut Section<LifecycleRow>) {
    let ops: Vec<&OpResult> = sec.rows.iter().flat_map(|r| r.ops.values()).collect();
    if !ops.is_empty() && ops.iter().all(|o| o.unavailable.is_some()) {
        sec.available = false;
        // The distinct server answers (an operation that needs another says so separately).
        let mut why: Vec<String> = ops
            .iter()
            .filter_map(|o| o.unavailable.clone())
            .filter(|u| !u.starts_with("needs "))
            .collect();
        why.sort();
        why.dedup();
        sec.reason = Some(why.join("; "));
    } else {
        let missing: Vec<String> = sec
            .rows
            .first()
            .map(|r| {
                r.ops
                    .iter()
                    .filter_map(|(k, o)| {
                        o.unavailable
                            .as_ref()
                            .map(|u| format!("{k} not available ({u})"))
                    })
                    .collect()
            })
            .unwrap_or_default();
        if !missing.is_empty() {
            sec.reason = Some(missing.join("; "));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(unavailable: Option<&str>, samples: &[f64]) -> OpResult {
        let mut o = Op {
            unavailable: unavailable.map(String::from),
            ..Op::default()
        };
        o.samples = samples.to_vec();
        o.result()
    }

    fn section(ops: Vec<(&str, OpResult)>) -> Section<LifecycleRow> {
        let mut s = Section::new("clock");
        s.rows.push(LifecycleRow {
            dirty_mib: 0,
            ops: ops.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        });
        s
    }

    #[test]
    fn all_unavailable_makes_the_section_unavailable_with_the_server_answers() {
        let mut s = section(vec![
            ("snapshot", op(Some("snapshot: HTTP 404: nf"), &[])),
            (
                "clone",
                op(Some("needs snapshots: snapshot: HTTP 404: nf"), &[]),
            ),
            ("fork", op(Some("fork: HTTP 501: no"), &[])),
        ]);
        mark_unavailable(&mut s);
        assert!(!s.available);
        assert_eq!(
            s.reason.as_deref(),
            Some("fork: HTTP 501: no; snapshot: HTTP 404: nf")
        );
    }

    #[test]
    fn partly_unavailable_stays_available_and_says_what_is_missing() {
        let mut s = section(vec![
            ("snapshot", op(None, &[40.0])),
            ("fork", op(Some("fork: HTTP 404: nf"), &[])),
        ]);
        mark_unavailable(&mut s);
        assert!(s.available);
        assert_eq!(
            s.reason.as_deref(),
            Some("fork not available (fork: HTTP 404: nf)")
        );
        let mut s = section(vec![("pause", op(None, &[1.0]))]);
        mark_unavailable(&mut s);
        assert!(s.available && s.reason.is_none());
    }

    #[test]
    fn unavailable_answers_are_not_failures() {
        let mut o = Op::default();
        let e = |status| -> Result<(), ApiError> {
            Err(ApiError::Status {
                op: "snapshot",
                status,
                body: "x".into(),
            })
        };
        o.record(1.0, &e(404));
        o.record(1.0, &e(501));
        assert_eq!(o.failures, 0);
        assert!(o.unavailable.as_deref().unwrap().contains("HTTP 404"));
        o.record(1.0, &e(500));
        o.record(2.5, &Ok::<(), ApiError>(()));
        let r = o.result();
        assert_eq!((r.failures, r.attempts), (1, 2));
        assert_eq!(r.samples_ms, vec![2.5]);
        assert!(r.errors[0].contains("HTTP 500"));
    }

    #[test]
    fn dirty_command_writes_the_asked_bytes() {
        let c = dirty_cmd(8);
        assert!(c.contains("head -c 8388608 /dev/urandom"), "{c}");
        assert!(c.contains("/dev/shm") && c.contains("/tmp"));
    }
}
