//! `cubectl up`, `down` and `status`: a whole Cube (cubelet, cube-master, cube-api) on this host,
//! owned by one data directory.

use crate::client::{self, Master, StatusExt};
use crate::daemons::{self, Daemon, Started};
use crate::layout::{self, Layout, Ports, Switch};
use crate::progress::{BuildProgress, Event};
use crate::{cleanup, configs, node, output, sandbox, template};
use anyhow::Context;
use clap::{Args, ValueEnum};
use cube_proto::master::v1 as pb;
use cube_proto::node::v1 as npb;
use serde_json::json;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Runtime {
    /// The strongest this host runs well: microVMs with VMX/SVM, else gVisor where runsc
    /// works, else namespaces.
    Auto,
    /// Sandboxes in Linux namespaces (shared host kernel).
    Namespace,
    /// gVisor sandboxes (runsc: a user-space kernel between sandbox and host).
    Gvisor,
    /// KVM microVMs.
    Microvm,
}

impl Runtime {
    fn as_str(self) -> &'static str {
        match self {
            Runtime::Auto => "auto",
            Runtime::Namespace => "namespace",
            Runtime::Gvisor => "gvisor",
            Runtime::Microvm => "microvm",
        }
    }
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// E2B REST API port (default 3000); the sandbox edge takes the next port. Fixed at the
    /// first `up` of a data directory.
    #[arg(long)]
    pub api_port: Option<u16>,
    /// Keep the daemons attached to this terminal; Ctrl-C stops them and cleans up.
    #[arg(long)]
    pub foreground: bool,
    /// Sandbox runtime (default auto at the first `up`, then what was chosen).
    #[arg(long, value_enum)]
    pub runtime: Option<Runtime>,
    /// Build the `base` template from this root filesystem directory instead of Debian bookworm
    /// (debootstrap, minutes the first time, cached afterwards).
    #[arg(long, value_name = "DIR")]
    pub base_dir: Option<PathBuf>,
    /// Do not build `base` when it is missing.
    #[arg(long)]
    pub no_base: bool,
    /// The cube-agent put into templates (default: /usr/lib/cube/cube-agent, else the build tree).
    #[arg(long, value_name = "PATH")]
    pub agent: Option<PathBuf>,
    /// Size of the sparse XFS image made when the data directory is not on XFS (first `up`).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub xfs_size_gib: u64,
    /// Sandboxes of `base` kept started for fast creation (written into cubelet.toml at the
    /// first `up`).
    #[arg(long, default_value_t = 8)]
    pub pool: u32,
    /// Seconds to wait for each daemon to become ready.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub wait: u64,
}

const XFS_SUPER_MAGIC: i64 = 0x5846_5342;

fn is_root() -> bool {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn on_xfs(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: zeroed statfs is a valid out-parameter; c is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0) && st.f_type as i64 == XFS_SUPER_MAGIC
}

/// An absolute, normalised data directory (created when `create`).
pub fn resolve_data_dir(p: &Path, create: bool) -> anyhow::Result<PathBuf> {
    if create {
        std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
    }
    match std::fs::canonicalize(p) {
        Ok(c) => Ok(c),
        Err(_) if p.is_absolute() => Ok(p.to_path_buf()),
        Err(_) => Ok(std::env::current_dir()?.join(p)),
    }
}

/// An exclusive lock on the data directory, so two `up`/`down` never interleave.
struct DirLock(#[allow(dead_code)] std::fs::File);

fn lock(data_dir: &Path) -> anyhow::Result<DirLock> {
    use std::os::fd::AsRawFd;
    let p = data_dir.join(".cubectl.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&p)
        .with_context(|| format!("opening {}", p.display()))?;
    // SAFETY: valid fd owned by f.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        anyhow::bail!(
            "another cubectl is running `up` or `down` on {}",
            data_dir.display()
        );
    }
    Ok(DirLock(f))
}

fn route_in_use(pool: &str) -> bool {
    std::process::Command::new("ip")
        .args(["-4", "route", "show", "root", pool])
        .output()
        .map(|o| !String::from_utf8_lossy(&o.stdout).trim().is_empty())
        .unwrap_or(false)
}

fn new_layout(data_dir: &Path, a: &UpArgs) -> anyhow::Result<Layout> {
    let default = data_dir == Path::new(layout::DEFAULT_DATA_DIR);
    let ports: Ports = layout::pick_ports(
        a.api_port.unwrap_or(layout::DEFAULT_API_PORT),
        &layout::port_free,
    )?;
    let tag = layout::tag(data_dir);
    let (run_dir, cgroup_parent, switch) = if default {
        (
            PathBuf::from("/run/cube"),
            "cube".to_string(),
            Switch {
                pin_root: "/sys/fs/bpf/cube".into(),
                nft_table: "cube_vs".into(),
                host_pool: "10.233.0.0/16".into(),
            },
        )
    } else {
        (
            PathBuf::from(format!("/run/cube-{tag}")),
            format!("cube-{tag}"),
            Switch {
                pin_root: format!("/sys/fs/bpf/cube-{tag}").into(),
                nft_table: format!("cube_{tag}"),
                host_pool: layout::host_pool(&tag, &route_in_use),
            },
        )
    };
    let node_dir = data_dir.join("node");
    Ok(Layout {
        format: layout::FORMAT,
        data_dir: data_dir.to_path_buf(),
        run_dir,
        xfs_loop_image: (!on_xfs(data_dir)).then(|| data_dir.join("node.xfs")),
        xfs_loop_size_gib: a.xfs_size_gib,
        node_dir,
        runtime: a.runtime.unwrap_or(Runtime::Auto).as_str().to_string(),
        cgroup_parent,
        ports,
        switch,
        checksum: String::new(),
    })
}

fn note(s: &str) {
    eprintln!("==> {s}");
}

/// Ports a daemon binds.
fn ports_of(l: &Layout, d: Daemon) -> Vec<u16> {
    match d {
        Daemon::Cubelet => vec![l.ports.cubelet_grpc, l.ports.cubelet_metrics],
        Daemon::Master => vec![l.ports.master_grpc, l.ports.master_metrics],
        Daemon::Api => vec![l.ports.api, l.ports.edge, l.ports.api_metrics],
    }
}

async fn ready(l: &Layout, d: Daemon) -> bool {
    match d {
        Daemon::Cubelet => {
            let port = l.ports.cubelet_metrics;
            tokio::task::spawn_blocking(move || crate::health::healthy(port, "/health"))
                .await
                .unwrap_or(false)
        }
        Daemon::Api => {
            let port = l.ports.api;
            tokio::task::spawn_blocking(move || crate::health::healthy(port, "/health"))
                .await
                .unwrap_or(false)
        }
        Daemon::Master => match client::connect(&l.master_url()).await {
            Ok(mut m) => m.list_nodes(pb::ListNodesRequest {}).await.is_ok(),
            Err(_) => false,
        },
    }
}

enum StartFailure {
    Exited(String),
    Timeout,
}

async fn wait_ready(
    l: &Layout,
    d: Daemon,
    s: &mut Started,
    wait: Duration,
) -> Result<(), StartFailure> {
    let end = Instant::now() + wait;
    loop {
        if let Some(st) = s.exited() {
            return Err(StartFailure::Exited(format!("exited with {st}")));
        }
        if ready(l, d).await {
            return Ok(());
        }
        if Instant::now() > end {
            return Err(StartFailure::Timeout);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn last_lines(s: &str, n: usize) -> String {
    let v: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    v[v.len().saturating_sub(n)..].join(" | ")
}

/// Starts one daemon unless it runs already.
async fn ensure_daemon(
    l: &Layout,
    d: Daemon,
    detach: bool,
    wait: Duration,
) -> anyhow::Result<Option<Started>> {
    if let Some(pid) = daemons::running(l, d) {
        if !detach {
            anyhow::bail!(
                "{} of {} already runs in the background (pid {pid}): `cubectl down --data-dir {}` first",
                d.name(),
                l.data_dir.display(),
                l.data_dir.display()
            );
        }
        if !ready(l, d).await {
            let end = Instant::now() + wait;
            while !ready(l, d).await {
                if Instant::now() > end {
                    anyhow::bail!(
                        "{} (pid {pid}) runs but is not ready; see {}",
                        d.name(),
                        l.log_path(d.name()).display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        note(&format!("{} already running (pid {pid})", d.name()));
        return Ok(None);
    }
    for p in ports_of(l, d) {
        if !layout::port_free(p) {
            anyhow::bail!(
                "port {p} (for {}) on 127.0.0.1 is in use by another program; stop it, or set up another data directory with another --api-port",
                d.name()
            );
        }
    }
    let bin = daemons::find_binary(d.name())?;
    let mut s = daemons::start(l, d, &bin, detach)?;
    match wait_ready(l, d, &mut s, wait).await {
        Ok(()) => {
            note(&format!("{} running (pid {})", d.name(), s.pid()));
            Ok(Some(s))
        }
        Err(StartFailure::Timeout) => {
            daemons::stop(s.pid(), Duration::from_secs(10));
            let _ = std::fs::remove_file(l.pid_path(d.name()));
            anyhow::bail!(
                "{} did not become ready in {}s: {} (log: {})",
                d.name(),
                wait.as_secs(),
                last_lines(&s.log_tail(4000), 3),
                s.log.display()
            );
        }
        Err(StartFailure::Exited(how)) => {
            let _ = std::fs::remove_file(l.pid_path(d.name()));
            let log = s.log_tail(8000);
            anyhow::bail!(
                "{} {how}: {} (log: {})",
                d.name(),
                last_lines(&log, 3),
                s.log.display()
            );
        }
    }
}

/// This install's node as the master sees it, once `pred` holds.
async fn wait_node(
    m: &mut Master,
    l: &Layout,
    what: &str,
    wait: Duration,
    pred: impl Fn(&pb::NodeInfo) -> bool,
) -> anyhow::Result<pb::NodeInfo> {
    let end = Instant::now() + wait;
    loop {
        let nodes = node::list(m).await?;
        let ours = nodes
            .iter()
            .find(|n| n.address == l.cubelet_url())
            .or(if nodes.len() == 1 {
                nodes.first()
            } else {
                None
            });
        if let Some(n) = ours {
            if pred(n) {
                return Ok(n.clone());
            }
        }
        if Instant::now() > end {
            anyhow::bail!(
                "timed out after {}s waiting for {what} (nodes: {})",
                wait.as_secs(),
                nodes
                    .iter()
                    .map(|n| format!("{} {} at {}", n.node_id, n.status, n.address))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Builds `base` through the master's stream; with a master that lacks it, through the node's own
/// stream; with a node that lacks that, through the node's unary ImportTemplate.
/// A directory bind-mounted into the node's staging directory while it is imported.
struct Staged(PathBuf);

impl Staged {
    fn bind(src: &Path, at: &Path) -> anyhow::Result<Staged> {
        let src = std::fs::canonicalize(src).with_context(|| src.display().to_string())?;
        let _ = std::process::Command::new("umount").arg(at).output();
        std::fs::create_dir_all(at).with_context(|| format!("creating {}", at.display()))?;
        let o = std::process::Command::new("mount")
            .arg("--bind")
            .arg(&src)
            .arg(at)
            .output()
            .context("running mount")?;
        if !o.status.success() {
            anyhow::bail!(
                "binding {} into the node's staging directory at {}: {}",
                src.display(),
                at.display(),
                String::from_utf8_lossy(&o.stderr).trim()
            );
        }
        Ok(Staged(at.to_path_buf()))
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).output();
        let _ = std::fs::remove_dir(&self.0);
    }
}

async fn build_base(
    m: &mut Master,
    l: &Layout,
    node_id: &str,
    recipe: npb::ImportTemplateRequest,
) -> anyhow::Result<()> {
    match template::build_via_master(m, recipe.clone(), node_id).await {
        Ok(_) => return Ok(()),
        Err(s) if s.code() == tonic::Code::Unimplemented => {}
        Err(s) => return Err(client::status("building template base", s)),
    }
    let mut n = npb::node_client::NodeClient::connect(l.cubelet_url())
        .await
        .with_context(|| format!("connecting to cubelet at {}", l.cubelet_url()))?;
    match n.build_template(recipe.clone()).await {
        Ok(r) => {
            let mut stream = r.into_inner();
            let mut bar = BuildProgress::new("template base");
            let mut result = Err(anyhow::anyhow!(
                "building template base: the node's build stream ended without a result"
            ));
            while let Some(ev) = stream
                .message()
                .await
                .map_err(|s| client::status("building template base", s))?
            {
                bar.event(&Event {
                    node: String::new(),
                    kind: ev.kind.clone(),
                    message: ev.message.clone(),
                    done: ev.done,
                    total: ev.total,
                });
                match ev.kind.as_str() {
                    "done" => result = Ok(()),
                    "error" => {
                        result = Err(anyhow::anyhow!("building template base: {}", ev.message))
                    }
                    _ => {}
                }
            }
            return result;
        }
        Err(s) if s.code() == tonic::Code::Unimplemented => {}
        Err(s) => return Err(client::status("building template base", s)),
    }
    let mut bar = BuildProgress::new("template base");
    bar.event(&Event {
        kind: "phase".into(),
        message: "building (no progress reported by this node)".into(),
        ..Default::default()
    });
    let t = n
        .import_template(recipe)
        .await
        .ctx("building template base")?;
    bar.event(&Event {
        kind: "done".into(),
        message: format!("build {} ({})", t.build, output::bytes(t.rootfs_bytes)),
        ..Default::default()
    });
    Ok(())
}

/// The install's API key: the saved one while the master still accepts it, else a new one.
async fn api_key(m: &mut Master, l: &Layout) -> anyhow::Result<String> {
    let path = l.api_key_path();
    if let Ok(k) = std::fs::read_to_string(&path) {
        let k = k.trim().to_string();
        if !k.is_empty()
            && m.validate_api_key(pb::ValidateApiKeyRequest { key: k.clone() })
                .await
                .is_ok()
        {
            return Ok(k);
        }
    }
    let r = m
        .create_api_key(pb::CreateApiKeyRequest {
            name: "cubectl-up".into(),
            team_id: String::new(),
        })
        .await
        .ctx("creating an API key")?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    use std::io::Write;
    writeln!(f, "{}", r.secret)?;
    std::fs::rename(&tmp, &path)?;
    note(&format!(
        "created API key {} (saved in {})",
        r.key.map(|k| k.id).unwrap_or_default(),
        path.display()
    ));
    Ok(r.secret)
}

fn write_if_missing(path: &Path, body: &str) -> anyhow::Result<()> {
    if path.exists() {
        return Ok(());
    }
    std::fs::write(path, body).with_context(|| format!("writing {}", path.display()))?;
    note(&format!("wrote {}", path.display()));
    Ok(())
}

pub async fn up(data_dir: &Path, a: UpArgs, as_json: bool) -> anyhow::Result<()> {
    if !is_root() {
        anyhow::bail!("cubectl up must run as root (the node creates namespaces, cgroups, loop mounts and eBPF programs)");
    }
    if let Some(d) = &a.base_dir {
        if !d.is_dir() {
            anyhow::bail!("--base-dir {}: not a directory", d.display());
        }
    }
    let data_dir = resolve_data_dir(data_dir, true)?;
    let _lock = lock(&data_dir)?;
    // Sandboxes reach the internet through the host (cube-vs masquerade).
    let fwd = Path::new("/proc/sys/net/ipv4/ip_forward");
    if std::fs::read_to_string(fwd).is_ok_and(|s| s.trim() == "0") {
        match std::fs::write(fwd, "1") {
            Ok(()) => note("enabled net.ipv4.ip_forward (sandboxes reach the internet through this host)"),
            Err(e) => eprintln!("warning: net.ipv4.ip_forward is 0 and could not be set ({e}): sandboxes will not reach the internet"),
        }
    }
    let mut l = match Layout::load(&data_dir) {
        Ok(l) => {
            if l.data_dir != data_dir {
                anyhow::bail!(
                    "{} records data directory {} (was it moved?): `cubectl down --purge` there and set up again",
                    Layout::path(&data_dir).display(),
                    l.data_dir.display()
                );
            }
            if let Some(p) = a.api_port.filter(|p| *p != l.ports.api) {
                anyhow::bail!(
                    "{} is set up with --api-port {}, not {p}: `cubectl down --purge --data-dir {}` to change it",
                    data_dir.display(),
                    l.ports.api,
                    data_dir.display()
                );
            }
            l
        }
        Err(layout::LayoutError::NotSetUp(..)) => {
            let l = new_layout(&data_dir, &a)?;
            l.save()?;
            note(&format!(
                "new install in {} (api port {}, master {}, cubelet {}, pool {})",
                data_dir.display(),
                l.ports.api,
                l.ports.master_grpc,
                l.ports.cubelet_grpc,
                l.switch.host_pool
            ));
            l
        }
        Err(e) => return Err(e.into()),
    };
    let agent = match &a.agent {
        Some(p) if p.is_file() => std::fs::canonicalize(p)?,
        Some(p) => anyhow::bail!("--agent {}: no such file", p.display()),
        None => daemons::find_agent()?,
    };
    std::fs::create_dir_all(data_dir.join("logs"))?;
    write_if_missing(
        &l.config_path("cubelet"),
        &configs::cubelet(&l, &agent, a.pool),
    )?;
    write_if_missing(&l.config_path("cube-master"), &configs::master(&l))?;
    write_if_missing(&l.config_path("cube-api"), &configs::api(&l))?;
    if let Some(r) = a.runtime.filter(|r| r.as_str() != l.runtime) {
        l.runtime = r.as_str().to_string();
        l.save()?;
        note(&format!("runtime set to {}", l.runtime));
        if daemons::running(&l, Daemon::Cubelet).is_some() {
            note("cubelet is running: the new runtime applies after `cubectl down` and `up`");
        }
    }
    // The recorded runtime wins at every start, so that `auto`, replaced by `namespace` for a
    // cubelet without it, is tried again after an update.
    let cubelet_cfg = l.config_path("cubelet");
    if daemons::running(&l, Daemon::Cubelet).is_none() {
        let text = std::fs::read_to_string(&cubelet_cfg)
            .with_context(|| format!("reading {}", cubelet_cfg.display()))?;
        let t: toml::Table =
            toml::from_str(&text).with_context(|| format!("parsing {}", cubelet_cfg.display()))?;
        if t.get("runtime").and_then(|v| v.as_str()) != Some(l.runtime.as_str()) {
            configs::edit_key(&cubelet_cfg, "runtime", Some(l.runtime.as_str().into()))?;
        }
    }

    let detach = !a.foreground;
    let wait = Duration::from_secs(a.wait);
    let mut started: Vec<(Daemon, Started)> = Vec::new();
    for d in Daemon::ALL {
        match ensure_daemon(&l, d, detach, wait).await {
            Ok(Some(s)) => started.push((d, s)),
            Ok(None) => {}
            Err(e) => {
                // Leave nothing half-started by this call behind.
                for (d, s) in started.iter().rev() {
                    daemons::stop(s.pid(), Duration::from_secs(20));
                    let _ = std::fs::remove_file(l.pid_path(d.name()));
                }
                return Err(e);
            }
        }
    }

    let result = finish_up(&l, &a, as_json).await;
    if a.foreground {
        if let Err(e) = result {
            // Nothing is usable: stop what this call started rather than wait.
            let r = teardown(&l, false).await?;
            print_teardown(&r, false);
            return Err(e);
        }
        foreground(&l, started).await
    } else {
        result.map_err(|e| {
            anyhow::anyhow!(
                "{e:#} (the daemons keep running: `cubectl status --data-dir {0}`, `cubectl down --data-dir {0}`)",
                l.data_dir.display()
            )
        })
    }
}

/// Template, API key and the printed environment, once the daemons run.
async fn finish_up(l: &Layout, a: &UpArgs, as_json: bool) -> anyhow::Result<()> {
    let wait = Duration::from_secs(a.wait);
    let mut m = client::connect(&l.master_url()).await?;
    let n = wait_node(
        &mut m,
        l,
        "the node to be ready in cube-master",
        wait,
        |n| n.status == "ready",
    )
    .await?;
    if !a.no_base && !n.templates.iter().any(|t| t == "base") {
        // The node imports only from its staging directory: the base root is bound there for
        // the build.
        let staged = a
            .base_dir
            .as_ref()
            .map(|d| Staged::bind(d, &l.node_dir.join("staging").join("cubectl-up-base")))
            .transpose()?;
        let source = match &staged {
            Some(s) => npb::import_template_request::Source::Directory(s.0.display().to_string()),
            None => {
                note("building template base from Debian bookworm (minutes the first time; cached in /var/cache/cube/templates)");
                npb::import_template_request::Source::Debootstrap(npb::DebootstrapSource::default())
            }
        };
        let recipe = npb::ImportTemplateRequest {
            name: "base".into(),
            source: Some(source),
            extra_mib: 0,
        };
        build_base(&mut m, l, &n.node_id, recipe).await?;
        drop(staged);
        wait_node(&mut m, l, "template base in cube-master", wait, |n| {
            n.status == "ready" && n.templates.iter().any(|t| t == "base")
        })
        .await?;
    }
    let key = api_key(&mut m, l).await?;
    let n = wait_node(&mut m, l, "the node", wait, |_| true).await?;
    if as_json {
        output::json(&json!({
            "dataDir": l.data_dir, "apiUrl": l.api_url(), "sandboxUrl": l.sandbox_url(),
            "apiKey": key, "masterUrl": l.master_url(), "runtime": n.runtime,
            "node": n.node_id, "foreground": a.foreground,
        }));
    } else {
        println!(
            "export E2B_API_URL={} E2B_SANDBOX_URL={} E2B_API_KEY={}",
            l.api_url(),
            l.sandbox_url(),
            key
        );
    }
    let dd = l.data_dir.display();
    note(&format!(
        "Cube is up (runtime: {}, isolation: {}). Logs: {dd}/logs. Status: cubectl status --data-dir {dd}. Stop: {}",
        n.runtime,
        cube_proto::isolation::of(&n.runtime),
        if a.foreground {
            "Ctrl-C".to_string()
        } else {
            format!("cubectl down --data-dir {dd}")
        }
    ));
    Ok(())
}

/// Runs until Ctrl-C, SIGTERM or a daemon's exit, then stops everything and cleans up.
async fn foreground(l: &Layout, mut started: Vec<(Daemon, Started)>) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let why = loop {
        tokio::select! {
            _ = term.recv() => break "SIGTERM".to_string(),
            _ = int.recv() => break "Ctrl-C".to_string(),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        if let Some(d) = started
            .iter_mut()
            .find_map(|(d, s)| s.exited().map(|st| format!("{} exited ({st})", d.name())))
        {
            break d;
        }
    };
    note(&format!("{why}: stopping"));
    let r = teardown(l, false).await?;
    print_teardown(&r, false);
    Ok(())
}

struct Teardown {
    sandboxes_killed: usize,
    stopped: Vec<String>,
    cleaned: Vec<String>,
    problems: Vec<String>,
    purged: bool,
}

/// Kills the install's sandboxes, stops its daemons and removes what its node left on the host.
async fn teardown(l: &Layout, purge: bool) -> anyhow::Result<Teardown> {
    let mut r = Teardown {
        sandboxes_killed: 0,
        stopped: vec![],
        cleaned: vec![],
        problems: vec![],
        purged: false,
    };
    // Through the master first, so that its records say killed (cubelet kills whatever is left
    // when it stops).
    if daemons::running(l, Daemon::Master).is_some() {
        match client::connect(&l.master_url()).await {
            Ok(mut m) => {
                let states = ["creating", "running", "pausing", "paused", "resuming"]
                    .map(String::from)
                    .to_vec();
                match sandbox::list_all(
                    &mut m,
                    states,
                    Default::default(),
                    String::new(),
                    usize::MAX,
                )
                .await
                {
                    Ok(v) => {
                        for s in v {
                            match m
                                .kill_sandbox(pb::SandboxRef {
                                    team_id: String::new(),
                                    sandbox_id: s.sandbox_id.clone(),
                                })
                                .await
                            {
                                Ok(_) => r.sandboxes_killed += 1,
                                Err(e) => r.problems.push(format!(
                                    "killing sandbox {}: {}",
                                    s.sandbox_id,
                                    e.message()
                                )),
                            }
                        }
                    }
                    Err(e) => r.problems.push(format!("{e:#}")),
                }
            }
            Err(e) => r.problems.push(format!("{e:#}")),
        }
    }
    for d in Daemon::ALL.iter().rev() {
        if let Some(pid) = daemons::running(l, *d) {
            let grace = Duration::from_secs(if *d == Daemon::Cubelet { 60 } else { 20 });
            let clean = tokio::task::spawn_blocking(move || daemons::stop(pid, grace))
                .await
                .unwrap_or(false);
            r.stopped.push(format!(
                "{} (pid {pid}){}",
                d.name(),
                if clean {
                    ""
                } else {
                    ", killed after the grace period"
                }
            ));
        }
        let _ = std::fs::remove_file(l.pid_path(d.name()));
    }
    let (cleaned, problems) = cleanup::clean(l);
    r.cleaned = cleaned;
    r.problems.extend(problems);
    if purge {
        let left = cleanup::mounts_under(&l.data_dir);
        if !left.is_empty() {
            r.problems.push(format!(
                "not purging {}: still mounted: {}",
                l.data_dir.display(),
                left.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        } else {
            std::fs::remove_dir_all(&l.data_dir)
                .with_context(|| format!("removing {}", l.data_dir.display()))?;
            r.purged = true;
        }
    }
    Ok(r)
}

fn print_teardown(r: &Teardown, as_json: bool) {
    if as_json {
        output::json(&json!({
            "sandboxesKilled": r.sandboxes_killed, "stopped": r.stopped, "cleaned": r.cleaned,
            "problems": r.problems, "purged": r.purged,
        }));
        return;
    }
    if r.sandboxes_killed > 0 {
        note(&format!("killed {} sandbox(es)", r.sandboxes_killed));
    }
    for s in &r.stopped {
        note(&format!("stopped {s}"));
    }
    for c in &r.cleaned {
        note(&format!("removed {c}"));
    }
    for p in &r.problems {
        eprintln!("warning: {p}");
    }
    if r.purged {
        note("data directory removed");
    }
}

pub async fn down(data_dir: &Path, purge: bool, as_json: bool) -> anyhow::Result<()> {
    if !is_root() {
        anyhow::bail!(
            "cubectl down must run as root (it unmounts and removes the node's network state)"
        );
    }
    let data_dir = resolve_data_dir(data_dir, false)?;
    let l = Layout::load(&data_dir)?;
    let lk = lock(&data_dir)?;
    let r = teardown(&l, purge).await?;
    drop(lk);
    print_teardown(&r, as_json);
    if !as_json && r.stopped.is_empty() {
        note("no daemon was running");
    }
    if !r.problems.is_empty() {
        anyhow::bail!(
            "down finished with {} problem(s) (see above)",
            r.problems.len()
        );
    }
    Ok(())
}

/// `status`: exit status 0 when every daemon runs and answers, 3 otherwise.
pub async fn status(data_dir: &Path, as_json: bool) -> anyhow::Result<i32> {
    let data_dir = resolve_data_dir(data_dir, false)?;
    let l = Layout::load(&data_dir)?;
    let mut daemons_v = Vec::new();
    let mut all_ok = true;
    for d in Daemon::ALL {
        let pid = daemons::running(&l, d);
        let healthy = pid.is_some() && ready(&l, d).await;
        all_ok &= healthy;
        daemons_v.push((d, pid, healthy));
    }
    let mut nodes = Vec::new();
    let mut sandboxes: Option<(usize, usize)> = None;
    let mut templates: Vec<String> = Vec::new();
    let mut problems = Vec::new();
    if daemons_v
        .iter()
        .any(|(d, p, _)| *d == Daemon::Master && p.is_some())
    {
        match client::connect(&l.master_url()).await {
            Ok(mut m) => {
                match node::list(&mut m).await {
                    Ok(n) => nodes = n,
                    Err(e) => problems.push(format!("{e:#}")),
                }
                match sandbox::list_all(
                    &mut m,
                    vec!["running".into(), "paused".into()],
                    Default::default(),
                    String::new(),
                    usize::MAX,
                )
                .await
                {
                    Ok(v) => {
                        let running = v.iter().filter(|s| s.state == "running").count();
                        sandboxes = Some((running, v.len() - running));
                    }
                    Err(e) => problems.push(format!("{e:#}")),
                }
                match m.list_templates(pb::ListTemplatesRequest {}).await {
                    Ok(r) => {
                        templates = r
                            .into_inner()
                            .templates
                            .into_iter()
                            .map(|t| t.name)
                            .collect()
                    }
                    // An older master: the templates its nodes report.
                    Err(s) if s.code() == tonic::Code::Unimplemented => {
                        templates = nodes.iter().flat_map(|n| n.templates.clone()).collect();
                    }
                    Err(s) => problems.push(client::status("listing templates", s).to_string()),
                }
                templates.sort();
                templates.dedup();
            }
            Err(e) => problems.push(format!("{e:#}")),
        }
    }
    let ours = nodes.iter().find(|n| n.address == l.cubelet_url());
    let runtime = ours.map(|n| n.runtime.clone()).unwrap_or_default();
    if as_json {
        output::json(&json!({
            "dataDir": l.data_dir,
            "up": all_ok,
            "daemons": daemons_v.iter().map(|(d, pid, healthy)| json!({
                "name": d.name(), "pid": pid, "running": pid.is_some(), "healthy": healthy,
                "log": l.log_path(d.name()),
            })).collect::<Vec<_>>(),
            "runtime": runtime,
            "runtimeRequested": l.runtime,
            "nodes": nodes.iter().map(node::node_json).collect::<Vec<_>>(),
            "sandboxes": sandboxes.map(|(r, p)| json!({"running": r, "paused": p})),
            "templates": templates,
            "urls": {"api": l.api_url(), "sandbox": l.sandbox_url(), "master": l.master_url()},
            "problems": problems,
        }));
    } else {
        println!(
            "Cube in {}: {}",
            l.data_dir.display(),
            if all_ok { "up" } else { "NOT fully up" }
        );
        for (d, pid, healthy) in &daemons_v {
            let state = match (pid, healthy) {
                (Some(p), true) => format!("running (pid {p})"),
                (Some(p), false) => format!("running (pid {p}) but not answering"),
                (None, _) => "stopped".into(),
            };
            println!("  {:<12} {state}", d.name());
        }
        println!(
            "  runtime      {}{}",
            if runtime.is_empty() {
                "-"
            } else {
                runtime.as_str()
            },
            if l.runtime != runtime {
                format!(" (asked: {})", l.runtime)
            } else {
                String::new()
            }
        );
        if let Some((r, p)) = sandboxes {
            println!("  sandboxes    {r} running, {p} paused");
        }
        println!("  templates    {}", output::list(&templates));
        println!(
            "  E2B_API_URL={} E2B_SANDBOX_URL={}",
            l.api_url(),
            l.sandbox_url()
        );
        println!("  master       {}", l.master_url());
        if !nodes.is_empty() {
            println!();
            node::print_nodes(&nodes);
        }
        for p in &problems {
            eprintln!("warning: {p}");
        }
    }
    Ok(if all_ok { 0 } else { 3 })
}
