//! The three daemons of a single-host install: finding their binaries, starting them detached
//! with pid files and logs, checking and stopping them.

use crate::layout::Layout;
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Directory of installed helper binaries (the static agent, daemons on a packaged install).
pub const LIB_DIR: &str = "/usr/lib/cube";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Daemon {
    Cubelet,
    Master,
    Api,
}

impl Daemon {
    /// Start order; stop in reverse.
    pub const ALL: [Daemon; 3] = [Daemon::Cubelet, Daemon::Master, Daemon::Api];

    pub fn name(self) -> &'static str {
        match self {
            Daemon::Cubelet => "cubelet",
            Daemon::Master => "cube-master",
            Daemon::Api => "cube-api",
        }
    }

    pub fn args(self, config: &Path) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec!["--config".into(), config.into()];
        match self {
            // `down` means down: sandboxes go with the node (a crash still leaves them for
            // re-adoption, since only a clean stop kills them).
            Daemon::Cubelet => v.extend(["run".into(), "--kill-sandboxes-on-exit".into()]),
            Daemon::Master => v.push("run".into()),
            Daemon::Api => {}
        }
        v
    }
}

fn exe_dir() -> Option<PathBuf> {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
}

fn executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A daemon binary: next to this cubectl (the build tree, or an install directory), then PATH,
/// then /usr/lib/cube.
pub fn find_binary(name: &str) -> anyhow::Result<PathBuf> {
    let mut cands: Vec<PathBuf> = exe_dir().into_iter().map(|d| d.join(name)).collect();
    if let Some(path) = std::env::var_os("PATH") {
        cands.extend(std::env::split_paths(&path).map(|d| d.join(name)));
    }
    cands.push(Path::new(LIB_DIR).join(name));
    for c in cands {
        if executable(&c) {
            return Ok(c);
        }
    }
    anyhow::bail!(
        "{name} not found (looked next to cubectl, in PATH and in {LIB_DIR}): build it with `cargo build -p {name}` or install it"
    )
}

/// The cube-agent that goes into templates: the installed static one, a static build in the
/// build tree (`target/x86_64-unknown-linux-gnu/{release,debug}`), or one next to cubectl.
pub fn find_agent() -> anyhow::Result<PathBuf> {
    let mut cands = vec![Path::new(LIB_DIR).join("cube-agent")];
    if let Some(d) = exe_dir() {
        if let Some(target) = d.parent() {
            for profile in ["release", "debug"] {
                cands.push(
                    target
                        .join("x86_64-unknown-linux-gnu")
                        .join(profile)
                        .join("cube-agent"),
                );
            }
        }
        cands.push(d.join("cube-agent"));
    }
    cands
        .into_iter()
        .find(|c| executable(c))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "cube-agent not found (looked in {LIB_DIR}, the build tree and next to cubectl): build it (see README) or pass --agent PATH"
            )
        })
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may itself hold spaces.
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X"),
        Err(_) => false,
    }
}

/// The pid of this install's running daemon, from its pid file; `None` when the file is missing
/// or stale (the process is gone, or the pid now belongs to another program).
pub fn running(l: &Layout, d: Daemon) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(l.pid_path(d.name()))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if !alive(pid) {
        return None;
    }
    // A recycled pid must not be mistaken for (and later killed as) our daemon: it must run with
    // this install's config file.
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let cfg = l.config_path(d.name());
    let want = cfg.as_os_str().as_encoded_bytes();
    cmdline.split(|b| *b == 0).any(|a| a == want).then_some(pid)
}

/// A started daemon and where its log of this start begins.
pub struct Started {
    pub child: Child,
    pub log: PathBuf,
    pub log_offset: u64,
}

impl Started {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the daemon logged since this start (the last `max` bytes).
    pub fn log_tail(&self, max: usize) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            let from = self.log_offset.max(len.saturating_sub(max as u64));
            if f.seek(SeekFrom::Start(from)).is_ok() {
                let _ = f.take(max as u64).read_to_string(&mut s);
            }
        }
        s
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// Starts a daemon with stdout/stderr appended to its log and its pid in its pid file. Detached
/// daemons get their own session (they outlive this cubectl and its terminal); foreground ones
/// their own process group, so that Ctrl-C reaches cubectl, which stops them in order.
pub fn start(l: &Layout, d: Daemon, bin: &Path, detach: bool) -> anyhow::Result<Started> {
    let log = l.log_path(d.name());
    if let Some(p) = log.parent() {
        std::fs::create_dir_all(p)?;
    }
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", log.display()))?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    writeln!(
        f,
        "===== {} started by cubectl at {} UTC",
        d.name(),
        crate::output::time_ms(now)
    )?;
    let log_offset = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut cmd = Command::new(bin);
    cmd.args(d.args(&l.config_path(d.name())))
        .stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f);
    if detach {
        // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    } else {
        cmd.process_group(0);
    }
    let child = cmd
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting {}: {e}", bin.display()))?;
    std::fs::create_dir_all(&l.run_dir)?;
    std::fs::write(l.pid_path(d.name()), format!("{}\n", child.id()))?;
    Ok(Started {
        child,
        log,
        log_offset,
    })
}

/// Stops a process: SIGTERM, then SIGKILL after `grace`. Returns false when it had to be killed.
pub fn stop(pid: u32, grace: Duration) -> bool {
    // SAFETY: plain signal delivery to a pid we own.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let end = Instant::now() + grace;
    while Instant::now() < end {
        reap(pid);
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    for _ in 0..100 {
        reap(pid);
        if !alive(pid) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Collects the exit status when the process is our child (foreground mode); harmless otherwise.
fn reap(pid: u32) {
    let mut st = 0;
    // SAFETY: non-blocking waitpid on one pid; fails with ECHILD when it is not our child.
    unsafe { libc::waitpid(pid as i32, &mut st, libc::WNOHANG) };
}
