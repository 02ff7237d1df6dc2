//! The result model and its writers: `cube-bench.json` (everything, raw samples included) and
//! `cube-bench.md` (the tables a person reads). Every section carries where its clock starts
//! and stops and the runtime it measured; the environment block carries machine and versions.

use crate::machine::Machine;
use crate::stats::Summary;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

pub const SCHEMA: &str = "cube-bench/1";

/// JSON has no NaN (serde_json writes it as null): read null back as NaN ("no value").
fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Environment {
    pub machine: Machine,
    /// `microvm`, `namespace` or `unknown`, and where that came from.
    pub runtime: String,
    pub runtime_source: String,
    /// The boundary that runtime puts around a sandbox, as the sandbox detail names it.
    #[serde(default)]
    pub isolation: String,
    pub versions: BTreeMap<String, String>,
    pub api_url: String,
    pub sandbox_url: String,
    pub template: String,
    /// The API is on this host, so host memory deltas mean something.
    pub api_local: bool,
    /// Nodes as the operator CLI lists them, when it was reachable.
    pub nodes: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Section<R> {
    pub available: bool,
    /// Why the section is empty or partial (e.g. the HTTP error of a missing route).
    pub reason: Option<String>,
    /// Exactly what the clock measures.
    pub clock: String,
    pub rows: Vec<R>,
}

impl<R> Section<R> {
    pub fn new(clock: &str) -> Section<R> {
        Section {
            available: true,
            reason: None,
            clock: clock.into(),
            rows: Vec::new(),
        }
    }

    /// A phase not run yet; what an interrupted run leaves in the JSON.
    pub fn pending(clock: &str) -> Section<R> {
        Section::unavailable(clock, "not run (the run stopped before this phase)".into())
    }

    pub fn unavailable(clock: &str, reason: String) -> Section<R> {
        Section {
            available: false,
            reason: Some(reason),
            clock: clock.into(),
            rows: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatencyRow {
    pub concurrency: usize,
    /// Attempts made before measuring and discarded.
    pub warmup: usize,
    pub attempts: usize,
    pub failures: usize,
    pub summary: Option<Summary>,
    /// First distinct error messages.
    pub errors: Vec<String>,
    pub samples_ms: Vec<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ThroughputRow {
    pub concurrency: usize,
    /// `create-delete` or `create-only`.
    pub mode: String,
    pub attempts: usize,
    pub ok: usize,
    pub failures: usize,
    #[serde(deserialize_with = "f64_or_nan")]
    pub wall_s: f64,
    /// Successful creates per second of wall time.
    #[serde(deserialize_with = "f64_or_nan")]
    pub creates_per_s: f64,
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DensityRow {
    /// Sandboxes asked for at this step.
    pub target: usize,
    /// Sandboxes alive when memory was read.
    pub live: usize,
    #[serde(deserialize_with = "f64_or_nan")]
    pub mem_available_before_mib: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub mem_available_after_mib: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub delta_mib: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub per_sandbox_mib: f64,
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpResult {
    /// Set when the server does not offer the operation (404/405/501), with its answer.
    pub unavailable: Option<String>,
    pub attempts: usize,
    pub failures: usize,
    pub summary: Option<Summary>,
    pub errors: Vec<String>,
    pub samples_ms: Vec<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LifecycleRow {
    /// MiB written inside the sandbox before the operations.
    pub dirty_mib: u64,
    /// Operation name → result (`pause`, `resume`; `snapshot`, `clone`, `fork`).
    pub ops: BTreeMap<String, OpResult>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub started_unix: u64,
    pub duration_s: f64,
    pub quick: bool,
    pub environment: Environment,
    pub create_latency: Section<LatencyRow>,
    pub create_to_first_command: Section<LatencyRow>,
    pub throughput: Section<ThroughputRow>,
    pub density: Section<DensityRow>,
    pub pause_resume: Section<LifecycleRow>,
    pub snapshot_clone: Section<LifecycleRow>,
}

fn f(v: f64) -> String {
    if v.is_finite() {
        if v.abs() >= 100.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    } else {
        "–".into()
    }
}

fn first_error(errors: &[String]) -> String {
    errors
        .first()
        .map(|e| e.replace('|', "\\|").replace('\n', " "))
        .unwrap_or_default()
}

fn caption<R>(out: &mut String, title: &str, s: &Section<R>, env: &Environment) {
    let _ = writeln!(out, "\n## {title}\n");
    let _ = writeln!(
        out,
        "Runtime **{}** · {} · clock: {}\n",
        env.runtime,
        env.machine.short(),
        s.clock
    );
    if !s.available {
        let _ = writeln!(
            out,
            "**Not available**: {}\n",
            s.reason.as_deref().unwrap_or("")
        );
    } else if let Some(r) = &s.reason {
        let _ = writeln!(out, "Note: {r}\n");
    }
}

fn latency_table(out: &mut String, rows: &[LatencyRow]) {
    if rows.is_empty() {
        return;
    }
    out.push_str(
        "| concurrency | n | failures | min | avg | p50 | p90 | p95 | p99 | max | first error |\n",
    );
    out.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for r in rows {
        let nan = f64::NAN;
        let s = r.summary.as_ref();
        let g = |h: fn(&Summary) -> f64| f(s.map(h).unwrap_or(nan));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.concurrency,
            s.map(|s| s.n).unwrap_or(0),
            r.failures,
            g(|s| s.min_ms),
            g(|s| s.avg_ms),
            g(|s| s.p50_ms),
            g(|s| s.p90_ms),
            g(|s| s.p95_ms),
            g(|s| s.p99_ms),
            g(|s| s.max_ms),
            first_error(&r.errors)
        );
    }
}

fn lifecycle_table(out: &mut String, rows: &[LifecycleRow]) {
    if rows.is_empty() {
        return;
    }
    out.push_str("| dirty MiB | operation | n | failures | min | avg | p50 | p95 | max | note |\n");
    out.push_str("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for r in rows {
        for (name, o) in &r.ops {
            let s = o.summary.as_ref();
            let g = |h: fn(&Summary) -> f64| f(s.map(h).unwrap_or(f64::NAN));
            let note = match &o.unavailable {
                Some(u) => format!("not available: {}", u.replace('|', "\\|")),
                None => first_error(&o.errors),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.dirty_mib,
                name,
                s.map(|s| s.n).unwrap_or(0),
                o.failures,
                g(|s| s.min_ms),
                g(|s| s.avg_ms),
                g(|s| s.p50_ms),
                g(|s| s.p95_ms),
                g(|s| s.max_ms),
                note
            );
        }
    }
}

/// The markdown report (all times in ms).
pub fn markdown(r: &Report) -> String {
    let e = &r.environment;
    let m = &e.machine;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# cube-bench results{}\n",
        if r.quick { " (--quick)" } else { "" }
    );
    out.push_str("| | |\n|---|---|\n");
    let rows = [
        (
            "Runtime",
            format!(
                "{} ({}), isolation {}",
                e.runtime,
                e.runtime_source,
                if e.isolation.is_empty() {
                    "unknown"
                } else {
                    &e.isolation
                }
            ),
        ),
        (
            "CPU",
            format!("{} ({} logical cores)", m.cpu_model, m.cores),
        ),
        ("Memory", format!("{} MiB", m.mem_total_mib)),
        ("KVM", format!("{} ({})", m.kvm_kind, m.kvm_detail)),
        ("Kernel", m.kernel.clone()),
        ("Host", m.hostname.clone()),
        ("API / edge", format!("{} / {}", e.api_url, e.sandbox_url)),
        ("Template", e.template.clone()),
        (
            "Versions",
            e.versions
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
        ("Started (unix)", r.started_unix.to_string()),
        ("Duration", format!("{:.1} s", r.duration_s)),
    ];
    for (k, v) in rows {
        let _ = writeln!(out, "| {k} | {} |", v.replace('|', "\\|"));
    }

    caption(&mut out, "Create latency (ms)", &r.create_latency, e);
    latency_table(&mut out, &r.create_latency.rows);

    caption(
        &mut out,
        "Create → first command `echo hi` done (ms)",
        &r.create_to_first_command,
        e,
    );
    latency_table(&mut out, &r.create_to_first_command.rows);

    caption(&mut out, "Throughput (creates/s)", &r.throughput, e);
    if !r.throughput.rows.is_empty() {
        out.push_str(
            "| concurrency | mode | creates ok | failures | wall s | creates/s | first error |\n",
        );
        out.push_str("|---:|---|---:|---:|---:|---:|---|\n");
        for t in &r.throughput.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.2} | {} | {} |",
                t.concurrency,
                t.mode,
                t.ok,
                t.failures,
                t.wall_s,
                f(t.creates_per_s),
                first_error(&t.errors)
            );
        }
    }

    caption(
        &mut out,
        "Density (host memory per idle sandbox)",
        &r.density,
        e,
    );
    if !r.density.rows.is_empty() {
        out.push_str("| live sandboxes | MemAvailable before MiB | after MiB | Δ MiB | MiB per sandbox | first error |\n");
        out.push_str("|---:|---:|---:|---:|---:|---|\n");
        for d in &r.density.rows {
            let _ = writeln!(
                out,
                "| {}{} | {} | {} | {} | {} | {} |",
                d.live,
                if d.live < d.target {
                    format!(" (of {})", d.target)
                } else {
                    String::new()
                },
                f(d.mem_available_before_mib),
                f(d.mem_available_after_mib),
                f(d.delta_mib),
                f(d.per_sandbox_mib),
                first_error(&d.errors)
            );
        }
    }

    caption(
        &mut out,
        "Pause / resume vs dirty memory (ms)",
        &r.pause_resume,
        e,
    );
    lifecycle_table(&mut out, &r.pause_resume.rows);

    caption(
        &mut out,
        "Snapshot / clone / fork vs dirty memory (ms)",
        &r.snapshot_clone,
        e,
    );
    lifecycle_table(&mut out, &r.snapshot_clone.rows);
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::stats::summarize;

    pub(crate) fn sample_report() -> Report {
        let machine = Machine {
            hostname: "h".into(),
            cpu_model: "Test CPU".into(),
            cores: 2,
            mem_total_mib: 4096,
            kvm_kind: "PVM".into(),
            kvm_detail: "test".into(),
            kernel: "6.1".into(),
        };
        let env = Environment {
            machine,
            runtime: "namespace".into(),
            runtime_source: "sandbox detail".into(),
            isolation: "shared-kernel".into(),
            versions: BTreeMap::from([("cube-bench".into(), "0.1.0".into())]),
            api_url: "http://127.0.0.1:3000".into(),
            sandbox_url: "http://127.0.0.1:3001".into(),
            template: "base".into(),
            api_local: true,
            nodes: None,
        };
        let samples = vec![10.0, 12.0, 30.0];
        let mut cl = Section::new("POST sent → 201 read");
        cl.rows.push(LatencyRow {
            concurrency: 5,
            warmup: 5,
            attempts: 4,
            failures: 1,
            summary: summarize(&samples, 1),
            errors: vec!["create: HTTP 429: a|b".into()],
            samples_ms: samples,
        });
        let mut tp = Section::new("first create sent → last create answered");
        tp.rows.push(ThroughputRow {
            concurrency: 5,
            mode: "create-only".into(),
            attempts: 10,
            ok: 10,
            failures: 0,
            wall_s: 0.5,
            creates_per_s: 20.0,
            errors: vec![],
        });
        let mut de = Section::new("MemAvailable");
        de.rows.push(DensityRow {
            target: 20,
            live: 16,
            mem_available_before_mib: 1000.0,
            mem_available_after_mib: 840.0,
            delta_mib: 160.0,
            per_sandbox_mib: 10.0,
            errors: vec!["capacity".into()],
        });
        let mut sc = Section::new("POST → 201");
        sc.rows.push(LifecycleRow {
            dirty_mib: 8,
            ops: BTreeMap::from([(
                "fork".to_string(),
                OpResult {
                    unavailable: Some("HTTP 404: Not found".into()),
                    attempts: 1,
                    failures: 1,
                    summary: None,
                    errors: vec![],
                    samples_ms: vec![],
                },
            )]),
        });
        Report {
            schema: SCHEMA.into(),
            started_unix: 1,
            duration_s: 2.0,
            quick: true,
            environment: env,
            create_latency: cl.clone(),
            create_to_first_command: cl,
            throughput: tp,
            density: de,
            pause_resume: Section::unavailable("x", "HTTP 501: no".into()),
            snapshot_clone: sc,
        }
    }

    #[test]
    fn markdown_has_every_section_and_escapes_pipes() {
        let md = markdown(&sample_report());
        for h in [
            "## Create latency",
            "## Create → first command",
            "## Throughput",
            "## Density",
            "## Pause / resume",
            "## Snapshot / clone / fork",
        ] {
            assert!(md.contains(h), "missing {h}:\n{md}");
        }
        assert!(md.contains("| 5 | 3 | 1 | 10.0 | 17.3 | 12.0 | 30.0 | 30.0 | 30.0 | 30.0 | create: HTTP 429: a\\|b |"), "{md}");
        assert!(
            md.contains("| 16 (of 20) | 1000 | 840 | 160 | 10.0 | capacity |"),
            "{md}"
        );
        assert!(md.contains("**Not available**: HTTP 501: no"));
        assert!(md.contains("not available: HTTP 404: Not found"));
        assert!(md.contains("Runtime **namespace** · Test CPU ×2 cores, 4 GiB, KVM PVM"));
        // Every row has as many cells as its header.
        for line in md.lines().filter(|l| l.starts_with('|')) {
            let cells = line.replace("\\|", "").matches('|').count();
            assert!(cells >= 3, "{line}");
        }
    }

    #[test]
    fn json_round_trips_with_all_sections() {
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&sample_report()).unwrap()).unwrap();
        assert_eq!(v["schema"], SCHEMA);
        for k in [
            "create_latency",
            "create_to_first_command",
            "throughput",
            "density",
            "pause_resume",
            "snapshot_clone",
        ] {
            assert!(v[k]["clock"].is_string(), "{k}");
            assert!(v[k]["rows"].is_array(), "{k}");
        }
        assert_eq!(v["create_latency"]["rows"][0]["summary"]["p50_ms"], 12.0);
        assert_eq!(v["environment"]["machine"]["kvm_kind"], "PVM");
        assert_eq!(v["pause_resume"]["available"], false);
    }

    #[test]
    fn json_reads_back_into_the_same_report_nan_included() {
        let mut r = sample_report();
        r.density.rows[0].per_sandbox_mib = f64::NAN;
        let text = serde_json::to_string(&r).unwrap();
        let back: Report = serde_json::from_str(&text).unwrap();
        assert!(back.density.rows[0].per_sandbox_mib.is_nan());
        assert_eq!(markdown(&back), markdown(&r));
    }
}
