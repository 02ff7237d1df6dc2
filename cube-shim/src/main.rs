//! `cube-shim`: see the crate docs for the control API and the jail.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use cube_hypervisor::Shape;
use cube_shim::jail;
use cube_shim::sandbox::Sandbox;
use cube_shim::server::Server;
use cube_shim::template::{self, GuestKind, LinuxBoot};

#[derive(Parser, Debug)]
#[command(about = "One sandbox: a pre-created VM shell and a control socket for cubelet")]
struct Args {
    /// vCPUs of the VM shell (must match the snapshots it will restore).
    #[arg(long)]
    vcpus: u8,
    /// Guest memory in MiB.
    #[arg(long)]
    mem_mib: u32,
    /// Control socket path (required unless --build-template).
    #[arg(long, required_unless_present = "build_template")]
    socket: Option<PathBuf>,
    /// Cgroup to create/join (relative name under --cgroup-root), limited to the shape.
    #[arg(long)]
    cgroup: Option<String>,
    #[arg(long, default_value = "/sys/fs/cgroup")]
    cgroup_root: PathBuf,
    /// Memory allowed beyond the guest's RAM in the cgroup (VMM, page tables, I/O buffers).
    #[arg(long, default_value_t = 128)]
    mem_overhead_mib: u64,
    /// Template to prepare the shell for (its memory is mapped now, so that restoring it
    /// only loads state). Other templates of the same shape still restore.
    #[arg(long)]
    template: Option<PathBuf>,
    /// Skip the seccomp filter (debugging only).
    #[arg(long)]
    no_seccomp: bool,
    /// Jail the shim (see `cube_shim::jail`): a private mount namespace rooted (pivot_root) at
    /// this (empty) directory, holding only /dev/kvm, /dev/net/tun, its own /proc and the
    /// --jail-* paths; its own PID namespace; its own unprivileged uid, no capabilities.
    #[arg(long)]
    jail_root: Option<PathBuf>,
    /// Absolute path visible read-write inside the jail at the same path (repeat; tests and
    /// debugging).
    #[arg(long, requires = "jail_root")]
    jail_bind: Vec<PathBuf>,
    /// Absolute path visible read-only inside the jail at the same path (repeat): the
    /// template snapshot.
    #[arg(long, requires = "jail_root")]
    jail_bind_ro: Vec<PathBuf>,
    /// The shim's own work directory (repeat): visible read-write inside the jail at the same
    /// path and handed to the shim's uid. Holds its control socket, vsock sockets, pause and
    /// snapshot output and the sandbox's disk (cubelet links it in).
    #[arg(long, requires = "jail_root")]
    jail_own: Vec<PathBuf>,
    /// Test aid: set up exactly as for serving, then run the escape probes of
    /// `cube_shim::probe`, print their JSON report and exit instead of serving.
    #[arg(long, hide = true)]
    self_test_escapes: bool,
    /// Test aid: a host file the probes try to open (repeat).
    #[arg(long, hide = true, requires = "self_test_escapes")]
    self_test_path: Vec<PathBuf>,
    /// Test aid: a unix socket the probes try to connect to (repeat).
    #[arg(long, hide = true, requires = "self_test_escapes")]
    self_test_socket: Vec<PathBuf>,
    /// Test aid: after the report, make this attempt the filter kills for.
    #[arg(long, hide = true, requires = "self_test_escapes")]
    self_test_fatal: Option<String>,
    /// Build mode: boot the guest (the agent stand-in, or --kernel) of this shape, wait for its
    /// ready point, snapshot it into this directory, and exit (no control socket). Jailed and
    /// filtered like a serving shim when --jail-root is given.
    #[arg(long)]
    build_template: Option<PathBuf>,
    /// Build mode: the template's disk image, attached as virtio-blk.
    #[arg(long, requires = "build_template")]
    disk: Option<PathBuf>,
    /// Build mode: attach a virtio-net device with this guest MAC (aa:bb:cc:dd:ee:ff).
    #[arg(long, requires = "build_template")]
    net_mac: Option<String>,
    /// Build mode: how long the guest may take to become ready (ms).
    #[arg(long, default_value_t = 30_000)]
    build_timeout_ms: u64,
    /// Build mode: boot this Linux kernel (cube-agent as init) instead of the agent stand-in.
    #[arg(long, requires = "build_template")]
    kernel: Option<PathBuf>,
    /// Build mode: the template's kernel arguments (devices, the init channel and host
    /// workarounds are appended).
    #[arg(
        long,
        requires = "kernel",
        default_value = "console=ttyS0 reboot=k panic=1 pci=off root=/dev/vda rw init=/sbin/init"
    )]
    cmdline: String,
    /// Build mode: an initramfs for --kernel.
    #[arg(long, requires = "kernel")]
    initramfs: Option<PathBuf>,
    /// Build mode: write the guest's console output here.
    #[arg(long, requires = "kernel")]
    console: Option<PathBuf>,
    /// Build mode: a writable directory for the build's vsock sockets (a jailed build has no
    /// /tmp); the temp dir when absent.
    #[arg(long, requires = "build_template")]
    build_scratch: Option<PathBuf>,
}

fn parse_mac(s: &str) -> anyhow::Result<[u8; 6]> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        anyhow::bail!("MAC {s:?}: expected six hex bytes separated by ':'");
    }
    let mut mac = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        mac[i] = u8::from_str_radix(p, 16).with_context(|| format!("MAC {s:?}"))?;
    }
    Ok(mac)
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Args::parse()) {
        eprintln!("cube-shim: {e:#}");
        std::process::exit(1);
    }
}

/// What [`confine`] leaves: the open KVM (when jailed it had to be opened inside the jail
/// while still privileged), the pid cubelet knows this shim by, and what `while_root` opened.
struct Confined<T> {
    vmm: Option<cube_hypervisor::Vmm>,
    host_pid: u32,
    opened: T,
}

/// Joins the cgroup and, with `--jail-root`, enters the jail (see `cube_shim::jail`; the same
/// sequence for serving and for template builds). `while_root` runs inside the jail before the
/// privileges go: files the shim must open but not own (a build's disk) are opened there.
fn confine<T>(
    args: &Args,
    while_root: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<Confined<T>> {
    if let Some(name) = &args.cgroup {
        let limits = jail::CgroupLimits {
            vcpus: args.vcpus,
            memory_bytes: (args.mem_mib as u64 + args.mem_overhead_mib) << 20,
        };
        let dirs = jail::join_cgroup(&args.cgroup_root, name, limits)
            .with_context(|| format!("join cgroup {name}"))?;
        tracing::info!(?dirs, "joined cgroup");
    }
    let Some(root) = &args.jail_root else {
        return Ok(Confined {
            vmm: None,
            host_pid: std::process::id(),
            opened: while_root()?,
        });
    };
    let id = jail::shim_id(std::process::id());
    let spec = jail::JailSpec {
        root,
        binds: &args.jail_bind,
        binds_ro: &args.jail_bind_ro,
        own: &args.jail_own,
        id,
    };
    // Single-threaded until the VM shell exists: the namespaces, root and credentials set here
    // are then shared by every thread.
    jail::ensure_single_threaded()?;
    jail::enter_mount_jail(&spec).with_context(|| format!("jail at {}", root.display()))?;
    // From here on this is PID 1 of its own namespace (the caller waits outside).
    let pidns = jail::enter_pid_ns(id)?;
    jail::mount_proc()?;
    // /dev/kvm (and /proc/cpuinfo for the CPU model hash) while still privileged.
    let vmm = cube_hypervisor::Vmm::new().context("open KVM")?;
    let opened = while_root()?;
    jail::restrict_proc()?;
    jail::drop_privileges(id, true)?;
    pidns.die_with_supervisor()?;
    Ok(Confined {
        vmm: Some(vmm),
        host_pid: pidns.host_pid,
        opened,
    })
}

/// No new privileges, then (unless `--no-seccomp`) the seccomp allow-list on every thread.
fn filter(args: &Args) -> anyhow::Result<bool> {
    jail::no_new_privs()?;
    if args.no_seccomp {
        return Ok(false);
    }
    jail::apply_seccomp()?;
    Ok(true)
}

/// `--self-test-escapes`: the probes' report on stdout, then the fatal probe if one is named;
/// the process ends here.
fn self_test(args: &Args) -> ! {
    use std::io::Write;
    let report = cube_shim::probe::run(&cube_shim::probe::Targets {
        paths: args.self_test_path.clone(),
        sockets: args.self_test_socket.clone(),
        read_only: args.jail_bind_ro.clone(),
    });
    println!("{report}");
    let _ = std::io::stdout().flush();
    if let Some(name) = &args.self_test_fatal {
        println!("{}", cube_shim::probe::fatal(name));
        let _ = std::io::stdout().flush();
        std::process::exit(3);
    }
    std::process::exit(0);
}

fn guest_kind(args: &Args) -> GuestKind {
    match &args.kernel {
        Some(k) => GuestKind::Linux(LinuxBoot {
            kernel: k.clone(),
            cmdline: args.cmdline.clone(),
            initramfs: args.initramfs.clone(),
            console: args.console.clone(),
        }),
        None => GuestKind::AgentStandin,
    }
}

/// Build mode: confined like a serving shim (the guest booted here runs the template's own
/// image), with the filter installed before the guest's first instruction.
fn build(args: &Args, shape: Shape, out: &std::path::Path) -> anyhow::Result<()> {
    let mac = args.net_mac.as_deref().map(parse_mac).transpose()?;
    let kind = guest_kind(args);
    let c = confine(args, || {
        args.disk
            .as_deref()
            .map(|d| {
                template::open_disk(d, &kind).with_context(|| format!("open disk {}", d.display()))
            })
            .transpose()
    })?;
    let vmm = match c.vmm {
        Some(v) => v,
        None => cube_hypervisor::Vmm::new().context("open KVM")?,
    };
    let spec = template::BuildSpec {
        kind,
        shape,
        disk: c.opened,
        net_mac: mac,
        timeout: std::time::Duration::from_millis(args.build_timeout_ms),
        scratch: args.build_scratch.as_deref(),
    };
    let m = template::build_with(&vmm, spec, out, &mut || {
        filter(args).map_err(|e| template::BuildError::Device(format!("{e:#}")))?;
        if args.self_test_escapes {
            // Where the guest would start: the VM and its devices exist, the filter is on.
            self_test(args);
        }
        Ok(())
    })
    .with_context(|| format!("build template into {}", out.display()))?;
    println!("{}", serde_json::to_string(&m).unwrap_or_default());
    Ok(())
}

fn run(args: Args) -> anyhow::Result<()> {
    let shape = Shape::new(args.vcpus, args.mem_mib);
    if let Some(out) = &args.build_template {
        return build(&args, shape, out);
    }
    let Some(socket) = args.socket.clone() else {
        anyhow::bail!("--socket is required");
    };
    let c = confine(&args, || Ok(()))?;
    let mut sandbox = match c.vmm {
        Some(vmm) => Sandbox::with_vmm(vmm, shape),
        None => Sandbox::new(shape),
    }
    .context("create the VM shell")?;
    sandbox.host_pid = c.host_pid;
    if let Some(t) = &args.template {
        sandbox
            .prepare(t)
            .map_err(|e| anyhow::anyhow!("prepare for template {}: {}", t.display(), e.message))?;
    }
    let server =
        Server::bind(&socket, sandbox).with_context(|| format!("bind {}", socket.display()))?;
    if filter(&args)? {
        server
            .sandbox()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .seccomp = true;
    }
    if args.self_test_escapes {
        self_test(&args);
    }
    tracing::info!(socket = %socket.display(), jail = args.jail_root.is_some(), vcpus = args.vcpus, mem_mib = args.mem_mib, seccomp = !args.no_seccomp, "ready");
    server.run().context("serve")?;
    Ok(())
}
