//! A real cubelet for tests: its own data dir, run dir, cgroup parent and ports, a fast
//! template built from host binaries, and a tonic client.
#![allow(dead_code)]

use cube_proto::nodev1 as pb;
use cube_proto::nodev1::node_client::NodeClient;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub const CUBELET: &str = env!("CARGO_BIN_EXE_cubelet");

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Finds a cube-agent binary: $CUBE_AGENT_BIN, the agent engineer's build, or ours.
pub fn agent_binary() -> PathBuf {
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("CUBE_AGENT_BIN") {
        cands.push(p.into());
    }
    if let Ok(t) = std::env::var("CARGO_TARGET_DIR") {
        cands.push(Path::new(&t).join("debug/cube-agent"));
    }
    cands.push("/var/tmp/tgt-cubelet/debug/cube-agent".into());
    cands.push("/var/tmp/tgt-agent/debug/cube-agent".into());
    for c in &cands {
        if c.exists() {
            return c.clone();
        }
    }
    panic!("no cube-agent binary found (tried {cands:?}); build it with `cargo build -p cube-agent` or set CUBE_AGENT_BIN");
}

/// A stripped copy of the agent: debug builds are tens of MiB, which every template
/// build and (without reflink) every disk clone would copy.
fn stripped_agent(root: &Path) -> PathBuf {
    let dst = root.join("cube-agent");
    let ok = Command::new("strip")
        .arg("-o")
        .arg(&dst)
        .arg(agent_binary())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        std::fs::copy(agent_binary(), &dst).unwrap();
    }
    dst
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Cubelet {
    pub name: String,
    pub root: PathBuf,
    pub config: PathBuf,
    pub grpc: String,
    pub http: String,
    pub child: Option<Child>,
    pub cgroup_parent: String,
}

#[derive(Default)]
pub struct Opts {
    /// Use the persistent debootstrap cache (/var/cache/cube/templates) instead of a temp one.
    pub shared_cache: bool,
    pub network_pool: u32,
    pub disk_pool: u32,
    pub started: u32,
    pub max_sandboxes: u32,
}

impl Cubelet {
    /// Prepares directories, config and the `mini` template (built from host binaries).
    pub fn new(tag: &str, o: Opts) -> Cubelet {
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let name = format!("t{}{}{n}", tag, std::process::id());
        let root = PathBuf::from(format!("/var/tmp/cubelet-test-{name}"));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let (g, h) = (free_port(), free_port());
        let cgroup_parent = format!("cube-test-{name}");
        let started = if o.started > 0 {
            format!("mini = {}", o.started)
        } else {
            String::new()
        };
        let cfg = format!(
            r#"grpc_addr = "127.0.0.1:{g}"
http_addr = "127.0.0.1:{h}"
data_dir = "{root}/data"
run_dir = "{root}/run"
cache_dir = "{cache}"
agent_binary = "{agent}"
[storage]
xfs_loop_image = "{root}/xfs.img"
xfs_loop_size_gib = 4
[sandbox]
max_sandboxes = {max}
tmp_size_mib = 16
ready_timeout_ms = 15000
[cgroup]
parent = "{cgroup_parent}"
[pools]
network = {net}
disks = {disks}
disk_templates = [{dt}]
refill_interval_ms = 50
[pools.started]
{started}
"#,
            root = root.display(),
            cache = if o.shared_cache {
                "/var/cache/cube/templates".to_string()
            } else {
                format!("{}/cache", root.display())
            },
            agent = stripped_agent(&root).display(),
            max = o.max_sandboxes,
            net = o.network_pool,
            disks = o.disk_pool,
            dt = if o.disk_pool > 0 { "\"mini\"" } else { "" },
        );
        let config = root.join("cubelet.toml");
        std::fs::write(&config, cfg).unwrap();
        let c = Cubelet {
            name,
            root: root.clone(),
            config,
            grpc: format!("http://127.0.0.1:{g}"),
            http: format!("127.0.0.1:{h}"),
            child: None,
            cgroup_parent,
        };
        let host = root.join("hostroot");
        run_ok(Command::new(CUBELET).arg("host-root").arg(&host));
        std::fs::write(host.join("marker"), b"mini template\n").unwrap();
        c.cli(&["build-template", "mini", "--dir", host.to_str().unwrap()]);
        c
    }

    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(CUBELET)
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cubelet {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into()
    }

    pub fn data(&self) -> PathBuf {
        self.root.join("data")
    }

    /// Starts the daemon and waits until its gRPC port answers.
    pub async fn start(&mut self) -> NodeClient<tonic::transport::Channel> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join("cubelet.log"))
            .unwrap();
        let child = Command::new(CUBELET)
            .arg("--config")
            .arg(&self.config)
            .arg("run")
            .arg("--kill-sandboxes-on-exit")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if let Ok(mut c) = NodeClient::connect(self.grpc.clone()).await {
                if c.node_status(pb::NodeStatusRequest {}).await.is_ok() {
                    return c;
                }
            }
            if let Some(ch) = self.child.as_mut() {
                if let Ok(Some(st)) = ch.try_wait() {
                    panic!("cubelet exited at start ({st}): {}", self.log());
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "cubelet did not start: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("cubelet.log")).unwrap_or_default()
    }

    /// Simulates a crash: SIGKILL, no cleanup.
    pub fn crash(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Graceful stop (SIGTERM): kills sandboxes (started with --kill-sandboxes-on-exit).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signal our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(60) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Everything this cubelet could have leaked: cgroups, netns files, links, loop devices,
    /// sandbox directories, pool disks.
    pub fn leftovers(&self) -> Vec<String> {
        let mut v = Vec::new();
        for h in ["", "cpu", "memory", "pids", "freezer"] {
            let d = Path::new("/sys/fs/cgroup")
                .join(h)
                .join(&self.cgroup_parent);
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.path().is_dir() {
                        v.push(format!("cgroup {}", e.path().display()));
                    }
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.root.join("run/netns")) {
            for e in rd.flatten() {
                v.push(format!("netns {}", e.path().display()));
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.data().join("sandboxes")) {
            for e in rd.flatten() {
                v.push(format!("dir {}", e.path().display()));
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.data().join("pool/disks")) {
            for e in rd.flatten() {
                v.push(format!("pool disk {}", e.path().display()));
            }
        }
        let xfs = self.root.join("xfs.img");
        for l in cubelet::runtime::loops_backed_under(&self.root) {
            let b = std::fs::read_to_string(format!("/sys/block/{l}/loop/backing_file"))
                .unwrap_or_default();
            if b.trim() != xfs.to_str().unwrap() {
                v.push(format!("loop {l}"));
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let data_mount = format!(" {} ", self.data().display());
        for m in mounts.lines() {
            if m.contains(self.root.to_str().unwrap()) && !m.contains(&data_mount) {
                v.push(format!("mount {m}"));
            }
        }
        v
    }

    /// Waits (asynchronous kernel teardown: loop autoclear, namespace release) until nothing is left.
    pub fn assert_clean(&self) {
        let start = Instant::now();
        loop {
            let l = self.leftovers();
            if l.is_empty() {
                return;
            }
            if start.elapsed() > Duration::from_secs(30) {
                panic!("leftovers after 30 s: {l:#?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Cubelet {
    fn drop(&mut self) {
        self.stop();
        // Belt and braces for a failed test: kill whatever is left in our cgroups.
        for h in ["", "cpu", "memory", "pids", "freezer"] {
            let d = Path::new("/sys/fs/cgroup")
                .join(h)
                .join(&self.cgroup_parent);
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    let _ = std::fs::write(e.path().join("freezer.state"), "THAWED");
                    for p in std::fs::read_to_string(e.path().join("cgroup.procs"))
                        .unwrap_or_default()
                        .lines()
                    {
                        if let Ok(pid) = p.parse::<i32>() {
                            // SAFETY: kill a pid from our own test cgroup.
                            unsafe { libc::kill(pid, libc::SIGKILL) };
                        }
                    }
                    std::thread::sleep(Duration::from_millis(50));
                    let _ = std::fs::remove_dir(e.path());
                }
                let _ = std::fs::remove_dir(&d);
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.root.join("run/netns")) {
            for e in rd.flatten() {
                let c = std::ffi::CString::new(e.path().to_str().unwrap()).unwrap();
                // SAFETY: detach our own netns bind mount.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
        let _ = cubelet::storage::unmount(&self.data());
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

fn run_ok(c: &mut Command) {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn create_req(id: &str) -> pb::CreateSandboxRequest {
    pb::CreateSandboxRequest {
        template: "mini".into(),
        sandbox_id: id.into(),
        shape: Some(pb::Shape {
            vcpus: 1,
            memory_mib: 256,
            disk_mib: 0,
        }),
        env_vars: [("FOO".to_string(), "bar".to_string())]
            .into_iter()
            .collect(),
        access_token: String::new(),
        ..Default::default()
    }
}

/// An agent client for a sandbox the gRPC answer describes.
pub fn agent_for(sb: &pb::Sandbox) -> cubelet::agent::AgentClient {
    cubelet::agent::AgentClient::new(
        &sb.host_interface,
        std::net::Ipv4Addr::new(169, 254, 77, 2),
        49983,
    )
}

/// Runs `sh -c script` in the sandbox; returns (exit code, stdout).
pub async fn sh(sb: &pb::Sandbox, script: &str) -> (i64, String) {
    let (code, out, err) = agent_for(sb)
        .run("/bin/sh", &["-c", script], None, Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("running {script:?} in {}: {e}", sb.sandbox_id));
    if code != 0 {
        eprintln!("{script:?} exited {code}: stderr {err}");
    }
    (code, out)
}
