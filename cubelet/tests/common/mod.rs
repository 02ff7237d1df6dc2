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

/// Finds a cube-agent binary: $CUBE_AGENT_BIN, else the workspace's debug build.
pub fn agent_binary() -> PathBuf {
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("CUBE_AGENT_BIN") {
        cands.push(p.into());
    }
    if let Ok(t) = std::env::var("CARGO_TARGET_DIR") {
        cands.push(Path::new(&t).join("debug/cube-agent"));
    }
    cands.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/cube-agent"));
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

/// A port held for this test process (cube-testkit), not one bound and closed.
fn free_port() -> u16 {
    cube_testkit::reserve_port()
}

pub struct Cubelet {
    pub name: String,
    pub root: PathBuf,
    pub config: PathBuf,
    pub grpc: String,
    pub http: String,
    pub child: Option<Child>,
    pub cgroup_parent: String,
    /// The switch's pin root (a bpffs of its own), nftables table and host address pool.
    pub pin_root: PathBuf,
    pub nft_table: String,
    pub host_pool: String,
    pub switch: bool,
}

#[derive(Default)]
pub struct Opts {
    /// `runtime` (default: cubelet's own default).
    pub runtime: Option<&'static str>,
    /// Use the persistent debootstrap cache (/var/cache/cube/templates) instead of a temp one.
    pub shared_cache: bool,
    pub network_pool: u32,
    /// Endpoints of killed sandboxes kept for reuse (`pools.network_recycle`); None = as many
    /// as `network_pool`, so a test's leak check after kills sees no recycled namespaces.
    pub network_recycle: Option<u32>,
    pub disk_pool: u32,
    pub started: u32,
    pub max_sandboxes: u32,
    /// `network.switch = "none"`.
    pub no_switch: bool,
    /// `sandbox.end_grace_s` (None: cubelet's default).
    pub end_grace_s: Option<u64>,
    /// `gvisor.pause_to_disk = true`.
    pub gvisor_pause_to_disk: bool,
    /// `pools.refill_delay_ms` (None: cubelet's default).
    pub refill_delay_ms: Option<u64>,
}

/// Programs of the `mini` template (the defaults plus netcat and timeout for network tests).
pub const MINI_PROGRAMS: &str =
    "sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,touch,sync,true,false,head,grep,nc,timeout";

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
        // A host pool of its own per cubelet: tests run in parallel in the host namespace, and
        // two switches handing out the same address would fight over its route.
        let pool_octet = (std::process::id().wrapping_mul(31).wrapping_add(n * 97)) % 254 + 1;
        let host_pool = format!("10.239.{pool_octet}.0/24");
        let pin_root = PathBuf::from(format!("/tmp/cubelet-bpf-{name}"));
        let nft_table = format!("cube_t_{name}");
        let cfg = format!(
            r#"{runtime}grpc_addr = "127.0.0.1:{g}"
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
{end_grace}[cgroup]
parent = "{cgroup_parent}"
[pools]
network = {net}
network_recycle = {recycle}
disks = {disks}
disk_templates = [{dt}]
refill_interval_ms = 50
{refill_delay}[network]
switch = "{switch}"
[journal]
sample_interval_ms = 500
[switch]
host_pool = "{host_pool}"
pin_root = "{pin}"
nft_table = "{nft_table}"
{gvisor}[pools.started]
{started}
"#,
            runtime = o
                .runtime
                .map(|r| format!("runtime = \"{r}\"\n"))
                .unwrap_or_default(),
            switch = if o.no_switch { "none" } else { "cube-vs" },
            pin = pin_root.display(),
            root = root.display(),
            cache = if o.shared_cache {
                "/var/cache/cube/templates".to_string()
            } else {
                format!("{}/cache", root.display())
            },
            agent = stripped_agent(&root).display(),
            max = o.max_sandboxes,
            gvisor = if o.gvisor_pause_to_disk {
                "[gvisor]\npause_to_disk = true\n"
            } else {
                ""
            },
            end_grace = o
                .end_grace_s
                .map(|g| format!("end_grace_s = {g}\n"))
                .unwrap_or_default(),
            refill_delay = o
                .refill_delay_ms
                .map(|d| format!("refill_delay_ms = {d}\n"))
                .unwrap_or_default(),
            net = o.network_pool,
            recycle = o.network_recycle.unwrap_or(o.network_pool),
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
            pin_root,
            nft_table,
            host_pool,
            switch: !o.no_switch,
        };
        let host = root.join("hostroot");
        run_ok(
            Command::new(CUBELET)
                .arg("host-root")
                .arg(&host)
                .arg("--programs")
                .arg(MINI_PROGRAMS),
        );
        std::fs::write(host.join("marker"), b"mini template\n").unwrap();
        c.cli(&["build-template", "mini", "--dir", host.to_str().unwrap()]);
        c
    }

    /// The node's staging directory (remote template imports read only from there); exists
    /// once the cubelet has started (the data dir is its XFS mount).
    pub fn staging(&self) -> PathBuf {
        self.root.join("data").join(cubelet::config::STAGING_DIR)
    }

    /// Copies `src` into the staging directory as `name`, for an import over gRPC.
    pub fn stage(&self, src: &Path, name: &str) -> PathBuf {
        let dst = self.staging().join(name);
        run_ok(Command::new("cp").arg("-a").arg(src).arg(&dst));
        dst
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
        for h in ["", "cpu", "memory", "pids", "freezer", "devices", "unified"] {
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
        for l in cubelet::runtime::namespace::loops_backed_under(&self.root) {
            let b = std::fs::read_to_string(format!("/sys/block/{l}/loop/backing_file"))
                .unwrap_or_default();
            if b.trim() != xfs.to_str().unwrap() {
                v.push(format!("loop {l}"));
            }
        }
        v.extend(self.switch_leftovers());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let data_mount = format!(" {} ", self.data().display());
        for m in mounts.lines() {
            if m.contains(self.root.to_str().unwrap()) && !m.contains(&data_mount) {
                v.push(format!("mount {m}"));
            }
        }
        v
    }

    /// Switch state this cubelet's sandboxes could have left: host routes into its pool, and
    /// entries in the pinned per-port maps (ports, policy, exposed ports, stats).
    pub fn switch_leftovers(&self) -> Vec<String> {
        let mut v = Vec::new();
        let routes = Command::new("ip")
            .args(["-4", "route", "show", "root", &self.host_pool])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for r in routes.lines().filter(|l| !l.trim().is_empty()) {
            v.push(format!("route {r}"));
        }
        for m in ["cvs_ports", "cvs_policy", "cvs_exposed", "cvs_stats"] {
            let n = self.switch_map_keys(m).len();
            if n > 0 {
                v.push(format!("{n} entries in switch map {m}"));
            }
        }
        v
    }

    /// Raw keys of a pinned switch map; empty when the map is not there.
    pub fn switch_map_keys(&self, map: &str) -> Vec<Vec<u8>> {
        let path = self.pin_root.join("maps").join(map);
        if !path.exists() {
            return vec![];
        }
        let out = Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned"])
            .arg(&path)
            .output()
            .expect("bpftool");
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "bpftool dump of {map}: {e}: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        j.as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|e| {
                e["key"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|b| {
                                b.as_str().and_then(|s| {
                                    u8::from_str_radix(s.trim_start_matches("0x"), 16).ok()
                                })
                            })
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Whether any per-port switch map still has an entry for `ifindex` (the LPM policy key
    /// starts with its prefix length, the others with the ifindex).
    pub fn switch_has_port(&self, ifindex: u32) -> Vec<String> {
        let le = ifindex.to_le_bytes();
        let mut v = Vec::new();
        for (m, off) in [
            ("cvs_ports", 0),
            ("cvs_stats", 0),
            ("cvs_exposed", 0),
            ("cvs_policy", 4),
            ("cvs_flows", 0),
        ] {
            let n = self
                .switch_map_keys(m)
                .iter()
                .filter(|k| k.len() >= off + 4 && k[off..off + 4] == le)
                .count();
            if n > 0 {
                v.push(format!("{n} entries for ifindex {ifindex} in {m}"));
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
        for h in ["", "cpu", "memory", "pids", "freezer", "devices", "unified"] {
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
                    let _ = std::fs::remove_dir(e.path().join("sandbox"));
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
        // The switch's node-level state (programs, maps, masquerade table) outlives a cubelet by
        // design; a test node is decommissioned here.
        let _ = Command::new("nft")
            .args(["delete", "table", "ip", &self.nft_table])
            .stderr(Stdio::null())
            .status();
        if let Ok(c) = std::ffi::CString::new(self.pin_root.to_str().unwrap()) {
            // SAFETY: detach the bpffs the switch mounted at our own pin root.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir_all(&self.pin_root);
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

/// The sandbox's agent address (`host address:49983` with cube-vs).
pub fn agent_addr(sb: &pb::Sandbox) -> std::net::SocketAddrV4 {
    sb.agent_address
        .parse()
        .unwrap_or_else(|e| panic!("agent address {:?}: {e}", sb.agent_address))
}

/// An agent client for a sandbox the gRPC answer describes: at its host address, or (no
/// switch) at the fixed guest address through its host interface.
pub fn agent_for(sb: &pb::Sandbox) -> cubelet::agent::AgentClient {
    let a = agent_addr(sb);
    let guest = std::net::Ipv4Addr::new(169, 254, 77, 2);
    let iface = (*a.ip() == guest).then_some(sb.host_interface.as_str());
    cubelet::agent::AgentClient::new(*a.ip(), a.port(), iface)
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
