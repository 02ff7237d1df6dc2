//! `cube-shim`: see the crate docs for the control API and the jail.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use cube_hypervisor::Shape;
use cube_shim::jail;
use cube_shim::sandbox::Sandbox;
use cube_shim::server::Server;

#[derive(Parser, Debug)]
#[command(about = "One sandbox: a pre-created VM shell and a control socket for cubelet")]
struct Args {
    /// vCPUs of the VM shell (must match the snapshots it will restore).
    #[arg(long)]
    vcpus: u8,
    /// Guest memory in MiB.
    #[arg(long)]
    mem_mib: u32,
    /// Control socket path.
    #[arg(long)]
    socket: PathBuf,
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

fn run(args: Args) -> anyhow::Result<()> {
    let shape = Shape::new(args.vcpus, args.mem_mib);
    if let Some(name) = &args.cgroup {
        let limits = jail::CgroupLimits {
            vcpus: args.vcpus,
            memory_bytes: (args.mem_mib as u64 + args.mem_overhead_mib) << 20,
        };
        let dirs = jail::join_cgroup(&args.cgroup_root, name, limits)
            .with_context(|| format!("join cgroup {name}"))?;
        tracing::info!(?dirs, "joined cgroup");
    }
    let mut sandbox = Sandbox::new(shape).context("create the VM shell")?;
    if let Some(t) = &args.template {
        sandbox
            .prepare(t)
            .map_err(|e| anyhow::anyhow!("prepare for template {}: {}", t.display(), e.message))?;
    }
    let server = Server::bind(&args.socket, sandbox)
        .with_context(|| format!("bind {}", args.socket.display()))?;
    jail::no_new_privs()?;
    if !args.no_seccomp {
        jail::apply_seccomp()?;
        server
            .sandbox()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .seccomp = true;
    }
    tracing::info!(socket = %args.socket.display(), vcpus = args.vcpus, mem_mib = args.mem_mib, seccomp = !args.no_seccomp, "ready");
    server.run().context("serve")?;
    Ok(())
}
