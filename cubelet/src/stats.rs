//! Resource use of one sandbox (SandboxStats): CPU and memory from its cgroup (v2 or v1),
//! disk from the filesystem the sandbox sees as `/`.
//!
//! CPU is reported as a percentage of the sandbox's vCPUs over the interval since the previous
//! sample of the same sandbox (or since it started), which is what E2B's `cpuUsedPct` means.

use crate::cgroup::CgroupMode;
use crate::error::NodeError;
use crate::runtime::host::Host;
use crate::sandbox::{Phase, SandboxState};
use cube_proto::nodev1 as pb;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// The previous sample per sandbox (keyed by id + cgroup key, so a reused id starts afresh):
/// (cpu µs, wall ms).
fn last_samples() -> &'static Mutex<HashMap<String, (u64, u64)>> {
    static M: OnceLock<Mutex<HashMap<String, (u64, u64)>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// A `key value` line of a stat file (`cpu.stat`, `memory.stat`).
fn stat_field(p: &Path, key: &str) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The sandbox's cgroup directories: (cpu, memory) — the same directory on v2.
fn cgroup_dirs(host: &Host, key: &str) -> Option<(PathBuf, PathBuf)> {
    let dirs: Vec<PathBuf> = host
        .cg
        .procs_files(key)
        .into_iter()
        .filter_map(|f| f.parent().map(Path::to_path_buf))
        .collect();
    match host.cg.mode() {
        CgroupMode::V2(_) => dirs.first().map(|d| (d.clone(), d.clone())),
        // v1 order is that of the controllers list: cpu, memory, pids, freezer.
        CgroupMode::V1(_) => Some((dirs.first()?.clone(), dirs.get(1)?.clone())),
    }
}

/// Clock ticks per second, for /proc times.
fn clk_tck() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// utime + stime + cutime + cstime of one process, in ticks. Summed over the sandbox's live
/// processes this counts every process exactly once: an exited child's time moves into its
/// reaper's `c*time` (the agent is PID 1 and reaps everything).
fn proc_ticks(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    // After the command: state is field 3, so utime (14) is index 11.
    let mut t = 0u64;
    for i in 11..15 {
        t += f.get(i)?.parse::<i64>().ok()?.max(0) as u64;
    }
    Some(t)
}

/// CPU time used by the sandbox so far, in µs.
fn cpu_usage_us(host: &Host, st: &SandboxState, cpu_dir: &Path) -> u64 {
    match host.cg.mode() {
        CgroupMode::V2(_) => {
            if let Some(u) = stat_field(&cpu_dir.join("cpu.stat"), "usage_usec") {
                return u;
            }
        }
        CgroupMode::V1(root) => {
            // cpuacct co-mounted with cpu ("cpu,cpuacct"), or mounted on its own with the
            // sandbox's processes in the same relative cgroup.
            let mut cands = vec![cpu_dir.join("cpuacct.usage")];
            if let Ok(rel) = cpu_dir.strip_prefix(root.join("cpu")) {
                cands.push(root.join("cpuacct").join(rel).join("cpuacct.usage"));
            }
            for c in cands {
                if let Some(ns) = read_u64(&c) {
                    return ns / 1000;
                }
            }
        }
    }
    // No accounting controller for this cgroup: add up its processes' times.
    let ticks: u64 = host
        .cg
        .pids(&st.key)
        .into_iter()
        .filter_map(proc_ticks)
        .sum();
    ticks * 1_000_000 / clk_tck()
}

/// (used, total) bytes of the filesystem at `p`.
fn fs_usage(p: &Path) -> Option<(u64, u64)> {
    let c = crate::storage::cstr(p);
    // SAFETY: statvfs into a zeroed struct.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    let f = s.f_frsize as u64;
    let total = s.f_blocks as u64 * f;
    let used = (s.f_blocks as u64).saturating_sub(s.f_bfree as u64) * f;
    Some((used, total))
}

fn host_mem_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// (vCPUs, % of them used since the previous sample of this sandbox or since its start, now).
pub(crate) fn cpu_pct(st: &SandboxState, usage: u64) -> (u32, f64, u64) {
    let now = now_ms();
    let cpu_count = st.shape.vcpus.max(1);
    let sample_key = format!("{}/{}", st.id, st.key);
    let (prev_usage, prev_ms) = {
        let mut m = last_samples().lock().unwrap_or_else(|p| p.into_inner());
        // Forget sandboxes that are gone, so the map does not grow with every sandbox ever made.
        if m.len() > 4096 {
            m.clear();
        }
        m.insert(sample_key, (usage, now))
            .unwrap_or((0, st.created_at_ms))
    };
    let wall_us = now.saturating_sub(prev_ms) * 1000;
    let cpu_used_pct = if st.phase == Phase::Running && wall_us > 0 {
        let pct = usage.saturating_sub(prev_usage) as f64 * 100.0
            / (wall_us as f64 * f64::from(cpu_count));
        pct.clamp(0.0, 100.0)
    } else {
        0.0
    };

    (cpu_count, cpu_used_pct, now)
}

/// (used, total) bytes of a disk image file: its allocated blocks and its size.
pub(crate) fn image_usage(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.blocks() * 512, m.len()))
}

/// One sample of a namespace sandbox's resource use.
pub fn sample(host: &Host, st: &SandboxState) -> Result<pb::SandboxStatsResponse, NodeError> {
    let (cpu_dir, mem_dir) = cgroup_dirs(host, &st.key)
        .ok_or_else(|| NodeError::Internal(format!("sandbox {}: no cgroup directories", st.id)))?;
    let usage = cpu_usage_us(host, st, &cpu_dir);
    let (cpu_count, cpu_used_pct, now) = cpu_pct(st, usage);

    let usage_bytes = host.cg.memory_bytes(&st.key).unwrap_or(0);
    let (cache, limit) = match host.cg.mode() {
        CgroupMode::V2(_) => (
            stat_field(&mem_dir.join("memory.stat"), "file").unwrap_or(0),
            // "max" (no limit) does not parse: fall back below.
            read_u64(&mem_dir.join("memory.max")),
        ),
        CgroupMode::V1(_) => (
            stat_field(&mem_dir.join("memory.stat"), "total_cache")
                .or_else(|| stat_field(&mem_dir.join("memory.stat"), "cache"))
                .unwrap_or(0),
            read_u64(&mem_dir.join("memory.limit_in_bytes")),
        ),
    };
    let host_mem = host_mem_bytes();
    let shape = st.shape.memory_mib << 20;
    // An unlimited cgroup reports a huge number: the sandbox's share is its shape, else the host.
    let mem_total = match limit {
        Some(l) if host_mem == 0 || l <= host_mem => l,
        _ if shape > 0 => shape,
        _ => host_mem,
    };

    // What the sandbox sees as `/` (its loop-mounted disk, in its own mount namespace); the
    // image file's size when its init is not there to look through.
    let disk = host.paths_for(&st.id).disk();
    let (disk_used, disk_total) = (st.pid > 0)
        .then(|| fs_usage(Path::new(&format!("/proc/{}/root", st.pid))))
        .flatten()
        .or_else(|| image_usage(&disk))
        .unwrap_or((0, 0));

    Ok(pb::SandboxStatsResponse {
        cpu_count,
        cpu_used_pct,
        mem_used_bytes: usage_bytes.saturating_sub(cache),
        mem_total_bytes: mem_total,
        mem_cache_bytes: cache,
        disk_used_bytes: disk_used,
        disk_total_bytes: disk_total,
        timestamp_ms: now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_times_and_stat_files() {
        // Burn a little CPU so that the count is not zero.
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert!(x != 1);
        let t = proc_ticks(std::process::id() as i32).expect("own /proc stat");
        assert!(t < 1_000_000_000);
        assert!(proc_ticks(-1).is_none());
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("cpu.stat");
        std::fs::write(&f, "usage_usec 1234\nuser_usec 1000\nsystem_usec 234\n").unwrap();
        assert_eq!(stat_field(&f, "usage_usec"), Some(1234));
        assert_eq!(stat_field(&f, "user_usec"), Some(1000));
        assert_eq!(stat_field(&f, "nope"), None);
        let (used, total) = fs_usage(dir.path()).unwrap();
        assert!(total > 0 && used <= total);
    }
}
