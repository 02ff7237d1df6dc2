//! Spawning cube-agent on a free loopback port and probing it through /proc.

use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::http::Conn;

pub struct Agent {
    pub child: Child,
    pub addr: SocketAddr,
}

pub struct Spawn<'a> {
    pub bin: &'a Path,
    pub extra_args: &'a [String],
    pub log: Option<PathBuf>,
}

fn free_addr() -> Result<SocketAddr> {
    // The port is released before the agent binds it; on loopback with ephemeral ports a
    // collision in that window is vanishingly rare and shows up as a failed start, not bad data.
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

impl Spawn<'_> {
    /// Starts the agent and returns it with the time from spawn to the first `/health` 204.
    pub fn start(&self, deadline: Duration) -> Result<(Agent, Duration)> {
        let addr = free_addr()?;
        let (stdout, stderr) = match &self.log {
            Some(p) => {
                let f = fs::OpenOptions::new().create(true).append(true).open(p)?;
                (Stdio::from(f.try_clone()?), Stdio::from(f))
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let mut cmd = Command::new(self.bin);
        cmd.arg("--addr")
            .arg(addr.to_string())
            .arg("--init")
            .arg("never")
            .args(self.extra_args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        let t0 = Instant::now();
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {}", self.bin.display()))?;
        let mut agent = Agent { child, addr };
        loop {
            if let Ok(mut c) = Conn::connect(addr, Duration::from_millis(100)) {
                if let Ok(r) = c.request("GET", "/health", &[], b"") {
                    if r.status == 204 {
                        return Ok((agent, t0.elapsed()));
                    }
                }
            }
            if let Some(st) = agent.child.try_wait()? {
                bail!("agent exited during start: {st}");
            }
            if t0.elapsed() > deadline {
                agent.stop();
                bail!("agent not healthy within {deadline:?}");
            }
            thread::sleep(Duration::from_micros(100));
        }
    }
}

impl Agent {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn rss_kib(&self) -> Result<u64> {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("no VmRSS in /proc/<pid>/status")
    }

    pub fn stop(&mut self) {
        // Nothing to flush in the agent for these runs; SIGKILL keeps teardown out of the timings.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}
