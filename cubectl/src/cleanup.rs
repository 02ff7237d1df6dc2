//! Host resources an install's node leaves behind, and their removal for `cubectl down`:
//! sandbox cgroups, network namespace files, host routes into the address pool, the masquerade
//! table, the switch's bpffs pins, and the XFS loop mount of the node's data directory.

use crate::layout::Layout;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Mount points at or below `dir` (from /proc/self/mountinfo), deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut v: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape(m)))
        .filter(|m| m.starts_with(dir))
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v.dedup();
    v
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let o = std::str::from_utf8(&b[i + 1..i + 4])
                .ok()
                .and_then(|x| u8::from_str_radix(x, 8).ok());
            if let Some(c) = o {
                out.push(c);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn is_mountpoint(p: &Path) -> bool {
    mounts_under(p).iter().any(|m| m == p)
}

fn umount(p: &Path, flags: libc::c_int) -> std::io::Result<()> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: valid C string.
    if unsafe { libc::umount2(c.as_ptr(), flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Unmounts, retrying briefly while busy (a just-stopped daemon's files closing), then lazily.
fn umount_patiently(p: &Path, notes: &mut Vec<String>) {
    for _ in 0..50 {
        match umount(p, 0) {
            Ok(()) => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return, // not mounted (any more)
            Err(e) => {
                notes.push(format!("unmounting {}: {e}", p.display()));
                return;
            }
        }
    }
    match umount(p, libc::MNT_DETACH) {
        Ok(()) => notes.push(format!("{} was busy: detached lazily", p.display())),
        Err(e) => notes.push(format!("unmounting {}: {e}", p.display())),
    }
}

fn quiet(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Removes what the stopped node of `l` left on the host. Returns what was removed (`done`) and
/// what could not be (`problems`).
pub fn clean(l: &Layout) -> (Vec<String>, Vec<String>) {
    let mut done = Vec::new();
    let mut problems = Vec::new();

    // Sandbox cgroups (cgroup v2, or the v1 controllers cubelet uses).
    for h in [
        "",
        "cpu",
        "cpu,cpuacct",
        "memory",
        "pids",
        "freezer",
        "cpuset",
    ] {
        let parent = Path::new("/sys/fs/cgroup").join(h).join(&l.cgroup_parent);
        if !parent.is_dir() {
            continue;
        }
        if let Ok(rd) = std::fs::read_dir(&parent) {
            for e in rd.flatten() {
                let p = e.path();
                if !p.is_dir() {
                    continue;
                }
                let _ = std::fs::write(p.join("cgroup.freeze"), "0");
                let _ = std::fs::write(p.join("freezer.state"), "THAWED");
                if std::fs::write(p.join("cgroup.kill"), "1").is_err() {
                    for pid in std::fs::read_to_string(p.join("cgroup.procs"))
                        .unwrap_or_default()
                        .split_whitespace()
                        .filter_map(|x| x.parse::<i32>().ok())
                    {
                        // SAFETY: signal delivery only.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
                let mut removed = false;
                for _ in 0..50 {
                    if std::fs::remove_dir(&p).is_ok() {
                        removed = true;
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                if removed {
                    done.push(format!("left-over cgroup {}", p.display()));
                } else {
                    problems.push(format!("cgroup {} could not be removed", p.display()));
                }
            }
        }
        if std::fs::remove_dir(&parent).is_err() && parent.exists() {
            problems.push(format!("cgroup {} could not be removed", parent.display()));
        }
    }

    // Network namespace files and anything else mounted in the run directory.
    for m in mounts_under(&l.run_dir) {
        umount_patiently(&m, &mut problems);
        done.push(format!("left-over mount {}", m.display()));
    }
    if l.run_dir.exists() && mounts_under(&l.run_dir).is_empty() {
        if let Err(e) = std::fs::remove_dir_all(&l.run_dir) {
            problems.push(format!("removing {}: {e}", l.run_dir.display()));
        }
    }

    // Host routes into the pool (one per sandbox; none once every sandbox was killed cleanly).
    let routes = Command::new("ip")
        .args(["-4", "route", "show", "root", &l.switch.host_pool])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    if !routes.is_empty() {
        if quiet(Command::new("ip").args(["-4", "route", "flush", "root", &l.switch.host_pool])) {
            done.push(format!("left-over routes into {}", l.switch.host_pool));
        } else {
            problems.push(format!("routes into {} remain", l.switch.host_pool));
        }
    }

    // The masquerade table.
    let t = &l.switch.nft_table;
    if quiet(Command::new("nft").args(["list", "table", "ip", t])) {
        if quiet(Command::new("nft").args(["delete", "table", "ip", t])) {
            done.push(format!("nftables table ip {t}"));
        } else {
            problems.push(format!("nftables table ip {t} could not be deleted"));
        }
    }

    // The switch's pins (maps, programs, links); a bpffs mounted on the pin root itself goes too.
    let root = &l.switch.pin_root;
    if root.exists() {
        remove_tree(root);
        if is_mountpoint(root) {
            umount_patiently(root, &mut problems);
            let _ = std::fs::remove_dir(root);
        }
        if root.exists() {
            problems.push(format!("bpf pins under {} remain", root.display()));
        } else {
            done.push(format!("cube-vs pins {}", root.display()));
        }
    }

    // The XFS loop mount (its loop device is released automatically), and anything a crashed
    // node left mounted below it.
    for m in mounts_under(&l.node_dir) {
        umount_patiently(&m, &mut problems);
        done.push(format!("mount {}", m.display()));
    }
    (done, problems)
}

/// Removes a directory tree file by file (bpffs has no recursive removal), ignoring errors.
fn remove_tree(p: &Path) {
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let q = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => {
                    remove_tree(&q);
                    let _ = std::fs::remove_dir(&q);
                }
                _ => {
                    let _ = std::fs::remove_file(&q);
                }
            }
        }
    }
    let _ = std::fs::remove_dir(p);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/x\\"), "/x\\");
        assert!(mounts_under(Path::new("/"))
            .iter()
            .any(|m| m == Path::new("/")));
        assert!(is_mountpoint(Path::new("/proc")));
    }
}
