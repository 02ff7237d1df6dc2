//! `--runtime namespace,gvisor,microvm`: each runtime measured on a throwaway single-host Cube
//! of its own (`cubectl up` in a data directory under the output directory, `cubectl down
//! --purge` after), one after the other on this host, and the results side by side with the
//! isolation each gives.

use crate::report::Report;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The runtimes cubelet knows (`cubectl up --runtime`).
pub const KNOWN: [&str; 3] = ["namespace", "gvisor", "microvm"];

pub const SCHEMA: &str = "cube-bench-runtimes/1";

/// How each stack is brought up (passed to `cubectl up`).
#[derive(Debug, Clone)]
pub struct StackOpts {
    pub cubectl: PathBuf,
    /// Parent of the stacks' data directories.
    pub dir: PathBuf,
    pub base_dir: Option<PathBuf>,
    pub agent: Option<PathBuf>,
    pub pool: u32,
    pub xfs_size_gib: u32,
}

/// A running single-host install; `cubectl down --purge` when dropped.
pub struct Stack {
    cubectl: PathBuf,
    pub data_dir: PathBuf,
    pub api_url: String,
    pub sandbox_url: String,
    pub api_key: String,
    pub master_url: String,
    pub runtime: String,
}

/// Checks a `--runtime` list: known names, each once.
pub fn validate(list: &[String]) -> Result<()> {
    for (i, r) in list.iter().enumerate() {
        if !KNOWN.contains(&r.as_str()) {
            bail!("--runtime: unknown runtime {r:?} (choose from namespace, gvisor, microvm)");
        }
        if list[..i].contains(r) {
            bail!("--runtime: {r:?} is listed twice");
        }
    }
    Ok(())
}

/// An API port whose next port (the edge) is free too.
fn free_pair() -> Result<u16> {
    use std::net::{Ipv4Addr, TcpListener};
    for _ in 0..50 {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let p = l.local_addr()?.port();
        if p < u16::MAX && TcpListener::bind((Ipv4Addr::LOCALHOST, p + 1)).is_ok() {
            return Ok(p);
        }
    }
    bail!("no two consecutive free ports on 127.0.0.1")
}

impl Stack {
    /// `cubectl --json up` of a new install running `runtime`.
    pub fn up(o: &StackOpts, runtime: &str) -> Result<Stack> {
        let data_dir = o.dir.join(runtime);
        if data_dir.exists() {
            bail!(
                "{} exists: a stack of an earlier run? (`cubectl down --purge --data-dir {0}`)",
                data_dir.display()
            );
        }
        let port = free_pair()?;
        let mut cmd = Command::new(&o.cubectl);
        cmd.arg("--json")
            .arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .args(["--runtime", runtime])
            .args(["--api-port", &port.to_string()])
            .args(["--pool", &o.pool.to_string()])
            .args(["--xfs-size-gib", &o.xfs_size_gib.to_string()])
            .env_remove("CUBE_MASTER_URL")
            .env_remove("CUBE_DATA_DIR");
        if let Some(b) = &o.base_dir {
            cmd.arg("--base-dir").arg(b);
        }
        if let Some(a) = &o.agent {
            cmd.arg("--agent").arg(a);
        }
        eprintln!("== {runtime}: cubectl up --data-dir {}", data_dir.display());
        let out = cmd
            .output()
            .with_context(|| format!("running {}", o.cubectl.display()))?;
        // From here the install may exist, partly: dropping the stack takes it down.
        let mut s = Stack {
            cubectl: o.cubectl.clone(),
            data_dir,
            api_url: String::new(),
            sandbox_url: String::new(),
            api_key: String::new(),
            master_url: String::new(),
            runtime: String::new(),
        };
        if !out.status.success() {
            bail!(
                "cubectl up --runtime {runtime} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("cubectl up printed no JSON: {:?}", out.stdout))?;
        let field = |k: &str| -> Result<String> {
            v[k].as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .with_context(|| format!("cubectl up: no {k:?} in {v}"))
        };
        s.api_url = field("apiUrl")?;
        s.sandbox_url = field("sandboxUrl")?;
        s.api_key = field("apiKey")?;
        s.master_url = field("masterUrl")?;
        s.runtime = field("runtime")?;
        if s.runtime != runtime {
            bail!(
                "asked cubectl up for {runtime}, the node runs {}",
                s.runtime
            );
        }
        Ok(s)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let out = Command::new(&self.cubectl)
            .args(["down", "--purge", "--data-dir"])
            .arg(&self.data_dir)
            .env_remove("CUBE_MASTER_URL")
            .env_remove("CUBE_DATA_DIR")
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "warning: cubectl down --data-dir {}: {}",
                self.data_dir.display(),
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => eprintln!("warning: cubectl down: {e}"),
        }
    }
}

/// One runtime's headline numbers (ms unless named otherwise; `None`: not measured).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Compared {
    pub runtime: String,
    pub isolation: String,
    /// Where its full report is.
    pub dir: PathBuf,
    /// Why it has no numbers, when it has none.
    pub error: Option<String>,
    pub create_p50_ms: Option<f64>,
    pub first_command_p50_ms: Option<f64>,
    pub peak_creates_per_s: Option<f64>,
    pub idle_mib_per_sandbox: Option<f64>,
    pub density_live: Option<usize>,
    /// Lifecycle p50s at the largest dirty size measured.
    pub dirty_mib: Option<u64>,
    pub pause_p50_ms: Option<f64>,
    pub resume_p50_ms: Option<f64>,
    pub snapshot_p50_ms: Option<f64>,
    pub clone_p50_ms: Option<f64>,
}

impl Compared {
    pub fn failed(runtime: &str, dir: &Path, error: String) -> Compared {
        Compared {
            runtime: runtime.into(),
            isolation: String::new(),
            dir: dir.into(),
            error: Some(error),
            create_p50_ms: None,
            first_command_p50_ms: None,
            peak_creates_per_s: None,
            idle_mib_per_sandbox: None,
            density_live: None,
            dirty_mib: None,
            pause_p50_ms: None,
            resume_p50_ms: None,
            snapshot_p50_ms: None,
            clone_p50_ms: None,
        }
    }

    /// The headline numbers of a finished run: the lowest concurrency's p50s, the best
    /// throughput, the last density step and the largest dirty size's lifecycle p50s.
    pub fn of(r: &Report, dir: &Path) -> Compared {
        let e = &r.environment;
        let p50 = |rows: &[crate::report::LatencyRow]| {
            rows.iter()
                .min_by_key(|x| x.concurrency)
                .and_then(|x| x.summary.as_ref())
                .map(|s| s.p50_ms)
        };
        let density = r
            .density
            .rows
            .last()
            .filter(|d| r.density.available && d.per_sandbox_mib.is_finite());
        let mut c = Compared::failed(&e.runtime, dir, String::new());
        c.error = None;
        c.isolation = e.isolation.clone();
        c.create_p50_ms = p50(&r.create_latency.rows);
        c.first_command_p50_ms = p50(&r.create_to_first_command.rows);
        c.peak_creates_per_s = r
            .throughput
            .rows
            .iter()
            .map(|t| t.creates_per_s)
            .filter(|v| v.is_finite())
            .reduce(f64::max);
        c.idle_mib_per_sandbox = density.map(|d| d.per_sandbox_mib);
        c.density_live = density.map(|d| d.live);
        let op = |sec: &crate::report::Section<crate::report::LifecycleRow>, name: &str| {
            sec.rows
                .iter()
                .max_by_key(|x| x.dirty_mib)
                .and_then(|x| x.ops.get(name))
                .and_then(|o| o.summary.as_ref())
                .map(|s| s.p50_ms)
        };
        c.dirty_mib = r.pause_resume.rows.iter().map(|x| x.dirty_mib).max();
        c.pause_p50_ms = op(&r.pause_resume, "pause");
        c.resume_p50_ms = op(&r.pause_resume, "resume");
        c.snapshot_p50_ms = op(&r.snapshot_clone, "snapshot");
        c.clone_p50_ms = op(&r.snapshot_clone, "clone");
        c
    }
}

#[derive(Debug, Serialize)]
pub struct Comparison<'a> {
    pub schema: &'static str,
    pub started_unix: u64,
    pub machine: &'a crate::machine::Machine,
    pub runtimes: &'a [Compared],
}

/// The side-by-side table.
pub fn markdown(rows: &[Compared], machine: &crate::machine::Machine) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# cube-bench: runtimes side by side\n\n{} · each runtime on its own single-host Cube, one after the other. \
         p50 at the lowest concurrency; lifecycle at the largest dirty size; each runtime's own report is in its directory.\n",
        machine.short()
    );
    out.push_str("| runtime | isolation | create p50 ms | create→echo p50 ms | peak creates/s | MiB per idle sandbox (live) | dirty MiB | pause p50 | resume p50 | snapshot p50 | clone p50 | note |\n");
    out.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    let f = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "–".into());
    for c in rows {
        let density = match (c.idle_mib_per_sandbox, c.density_live) {
            (Some(m), Some(n)) => format!("{m:.1} ({n})"),
            _ => "–".into(),
        };
        let note = c
            .error
            .as_deref()
            .map(|e| e.replace('|', "\\|").replace('\n', " "))
            .unwrap_or_else(|| c.dir.display().to_string());
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            c.runtime,
            if c.isolation.is_empty() {
                "–"
            } else {
                &c.isolation
            },
            f(c.create_p50_ms),
            f(c.first_command_p50_ms),
            f(c.peak_creates_per_s),
            density,
            c.dirty_mib
                .map(|d| d.to_string())
                .unwrap_or_else(|| "–".into()),
            f(c.pause_p50_ms),
            f(c.resume_p50_ms),
            f(c.snapshot_p50_ms),
            f(c.clone_p50_ms),
            note
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_checked() {
        assert!(validate(&["namespace".into(), "gvisor".into()]).is_ok());
        assert!(validate(&["kvm".into()])
            .unwrap_err()
            .to_string()
            .contains("unknown"));
        let twice = validate(&["gvisor".into(), "gvisor".into()]).unwrap_err();
        assert!(twice.to_string().contains("twice"));
    }

    #[test]
    fn headline_numbers_come_from_the_report() {
        let r = crate::report::tests::sample_report();
        let c = Compared::of(&r, Path::new("/o/namespace"));
        assert_eq!(c.runtime, "namespace");
        assert_eq!(c.isolation, "shared-kernel");
        assert_eq!(c.create_p50_ms, Some(12.0));
        assert_eq!(c.peak_creates_per_s, Some(20.0));
        assert_eq!(c.density_live, Some(16));
        assert_eq!(c.idle_mib_per_sandbox, Some(10.0));
        assert!(c.error.is_none());
        let bad = Compared::failed("gvisor", Path::new("/o/gvisor"), "up failed: x|y".into());
        let md = markdown(&[c, bad], &r.environment.machine);
        assert!(md.contains("| namespace | shared-kernel | 12.0 |"), "{md}");
        assert!(
            md.contains("| gvisor | – | – |") && md.contains("up failed: x\\|y"),
            "{md}"
        );
    }
}
