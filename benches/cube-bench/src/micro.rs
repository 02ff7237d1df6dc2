//! `cube-bench vmm`: runs the component micro-benchmarks (their own binaries) from the same
//! entry point and gathers their JSON into one out dir and one `micro.json` / `micro.md`.

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

pub struct MicroBench {
    pub name: &'static str,
    pub what: &'static str,
    /// Extra arguments for `--quick`.
    pub quick_args: &'static [&'static str],
}

pub const ALL: &[MicroBench] = &[
    MicroBench {
        name: "vmm-bench",
        what: "cube-hypervisor: restore into a pre-created shell, cold restore, pause-to-disk/resume, VMM memory overhead",
        quick_args: &["--iterations", "10"],
    },
    MicroBench {
        name: "shim-bench",
        what: "cube-shim: restore through the control socket, memory per idle shim, pause/resume",
        quick_args: &["--iterations", "10", "--shims", "5"],
    },
    MicroBench {
        name: "agent-bench",
        what: "cube-agent: start to healthy, process.Process/Start round trip, idle RSS",
        quick_args: &["--iterations", "200", "--warmup", "20", "--start-runs", "10", "--bash-iterations", "20"],
    },
    MicroBench {
        name: "vs-bench",
        what: "cube-vs: tap pool fill rate, bind cost, per-packet datapath overhead",
        quick_args: &["--pool", "100", "--tcx", "5", "--secs", "1"],
    },
    MicroBench {
        name: "node-bench",
        what: "cubelet: CreateSandbox to agent healthy (warm pool / cold), memory per idle sandbox",
        quick_args: &["--iterations", "20", "--idle", "20"],
    },
];

/// The default set: the VMM path (hypervisor, shim, agent).
pub const DEFAULT: &[&str] = &["vmm-bench", "shim-bench", "agent-bench"];

fn find_bin(name: &str, bin_dir: Option<&Path>) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = bin_dir {
        dirs.push(d.to_path_buf());
    }
    if let Some(d) = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
    {
        dirs.push(d);
    }
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

fn json_files(dir: &Path) -> Map<String, Value> {
    let mut m = Map::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return m;
    };
    let mut files: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    files.sort();
    for p in files {
        if p.extension().is_some_and(|e| e == "json") {
            let v = std::fs::read(&p)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .unwrap_or_else(|| json!({"error": "unreadable JSON"}));
            if let Some(n) = p.file_name() {
                m.insert(n.to_string_lossy().into_owned(), v);
            }
        }
    }
    m
}

fn tail(b: &[u8], n: usize) -> String {
    let s = String::from_utf8_lossy(b);
    let start = s.len().saturating_sub(n);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    s[i..].to_string()
}

pub fn run(
    out: &Path,
    only: &[String],
    bin_dir: Option<&Path>,
    quick: bool,
    agent_bin: Option<&Path>,
) -> Result<bool> {
    let micro = out.join("micro");
    std::fs::create_dir_all(&micro).with_context(|| format!("creating {}", micro.display()))?;
    let mut results = Map::new();
    let mut md = String::from("# Component micro-benchmarks\n\n| bench | what | status | wall s | results |\n|---|---|---|---:|---|\n");
    let mut all_ok = true;
    for b in ALL.iter().filter(|b| only.iter().any(|o| o == b.name)) {
        let dir = micro.join(b.name);
        std::fs::create_dir_all(&dir)?;
        let Some(bin) = find_bin(b.name, bin_dir) else {
            let msg = format!("binary not found: build it with `cargo build --release -p {}` (looked in --bin-dir, next to cube-bench, PATH)", b.name);
            eprintln!("{}: {msg}", b.name);
            results.insert(b.name.into(), json!({"status": "missing", "error": msg}));
            let _ = writeln!(md, "| {} | {} | missing | – | {msg} |", b.name, b.what);
            all_ok = false;
            continue;
        };
        let mut cmd = Command::new(&bin);
        cmd.arg("--out").arg(&dir);
        if quick {
            cmd.args(b.quick_args);
        }
        if b.name == "agent-bench" {
            let agent = agent_bin
                .map(Path::to_path_buf)
                .or_else(|| std::env::var_os("CUBE_AGENT_BIN").map(PathBuf::from))
                .or_else(|| find_bin("cube-agent", bin_dir));
            if let Some(a) = agent {
                cmd.arg("--agent-bin").arg(a);
            }
        }
        eprintln!("running {} …", bin.display());
        let t0 = Instant::now();
        let o = cmd.output();
        let wall = t0.elapsed().as_secs_f64();
        let (status, code, stdout, stderr) = match o {
            Ok(o) => (
                if o.status.success() { "ok" } else { "failed" },
                o.status.code(),
                o.stdout,
                o.stderr,
            ),
            Err(e) => ("failed", None, Vec::new(), e.to_string().into_bytes()),
        };
        all_ok &= status == "ok";
        let _ = std::fs::write(dir.join("stdout.txt"), &stdout);
        let _ = std::fs::write(dir.join("stderr.txt"), &stderr);
        print!("{}", String::from_utf8_lossy(&stdout));
        if status != "ok" {
            eprintln!("{} failed ({code:?}): {}", b.name, tail(&stderr, 600));
        }
        let files = json_files(&dir);
        let names: Vec<String> = files.keys().cloned().collect();
        let _ = writeln!(
            md,
            "| {} | {} | {status} | {wall:.1} | {} |",
            b.name,
            b.what,
            if names.is_empty() {
                tail(&stderr, 120).replace(['\n', '|'], " ")
            } else {
                names.join(", ")
            }
        );
        results.insert(
            b.name.into(),
            json!({"status": status, "exit_code": code, "wall_s": wall, "binary": bin,
                   "quick": quick, "stderr_tail": tail(&stderr, 2000), "results": files}),
        );
    }
    let report = json!({"schema": "cube-bench-micro/1", "benches": results});
    std::fs::write(out.join("micro.json"), serde_json::to_vec_pretty(&report)?)?;
    std::fs::write(out.join("micro.md"), &md)?;
    println!("{md}");
    eprintln!("wrote {}", out.display());
    Ok(all_ok)
}
