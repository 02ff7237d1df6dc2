//! `cube-agent`: PID 1 and the envd protocol server inside every sandbox.

use anyhow::Context;
use clap::{Parser, ValueEnum};
use cube_agent::{
    config::Config, init, reaper, server, state::AgentState, users, version, vsock_init,
};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum InitMode {
    /// Do PID-1 duties only when running as PID 1.
    Auto,
    Always,
    Never,
}

#[derive(Parser, Debug)]
#[command(name = "cube-agent", version = version::ENVD_VERSION, about = "Cube in-sandbox agent (envd protocol)")]
struct Cli {
    /// Address to serve the envd protocol on.
    #[arg(long, env = "CUBE_AGENT_ADDR", default_value = "0.0.0.0:49983")]
    addr: String,
    /// Whether to act as init (mounts, hostname, network, reaping).
    #[arg(long, env = "CUBE_AGENT_INIT", value_enum, default_value = "auto")]
    init: InitMode,
    /// TOML config file; a missing file means defaults.
    #[arg(
        long,
        env = "CUBE_AGENT_CONFIG",
        default_value = "/etc/cube-agent.toml"
    )]
    config: PathBuf,
    /// User for requests that name none (default: `user` if it exists, else the agent's own).
    #[arg(long, env = "CUBE_AGENT_DEFAULT_USER")]
    default_user: Option<String>,
    /// Serve the code-interpreter protocol on this port (enables it regardless of the config).
    #[arg(long, env = "CUBE_AGENT_INTERPRETER_PORT")]
    interpreter_port: Option<u16>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(
            std::env::var("CUBE_AGENT_LOG")
                .ok()
                .and_then(|l| l.parse::<tracing::Level>().ok())
                .unwrap_or(tracing::Level::INFO),
        )
        .init();
    // SAFETY: getpid cannot fail.
    let is_pid1 = unsafe { libc::getpid() } == 1;
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        // As a VM's init the kernel passes its unknown parameters (`nopv`, ...) as arguments:
        // ignore them (settings come from the environment) rather than exit, which would panic
        // the kernel.
        Err(e) if is_pid1 && e.kind() != clap::error::ErrorKind::DisplayHelp => {
            tracing::warn!(
                "ignoring arguments: {}",
                e.to_string().lines().next().unwrap_or("")
            );
            Cli::parse_from(["cube-agent"])
        }
        Err(e) => e.exit(),
    };
    let is_init = match cli.init {
        InitMode::Auto => is_pid1,
        InitMode::Always => true,
        InitMode::Never => false,
    };
    loop {
        match run(&cli, is_init) {
            Ok(()) => return,
            Err(e) if is_init => {
                // PID 1 must never exit (the kernel would panic): log and retry.
                tracing::error!("agent failed: {e:#}; retrying in 1 s");
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
            Err(e) => {
                eprintln!("cube-agent: {e:#}");
                std::process::exit(1);
            }
        }
    }
}

/// Binds the code-interpreter port and pre-starts the default context. A failure here is
/// logged, never fatal: envd must keep serving.
async fn start_interpreter(
    icfg: &cube_agent::interpreter::InterpreterConfig,
    state: cube_agent::state::Shared,
) {
    let addr = format!("{}:{}", icfg.address, icfg.port);
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("code interpreter: binding {addr}: {e}");
            return;
        }
    };
    let interp = cube_agent::interpreter::Interpreter::new(state.clone(), icfg.clone());
    tracing::info!(%addr, "serving the code-interpreter protocol");
    if icfg.prestart {
        let i = interp.clone();
        use std::sync::atomic::Ordering;
        state.warming.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            i.prestart().await;
            state.warming.fetch_sub(1, Ordering::SeqCst);
        });
    }
    tokio::spawn(cube_agent::interpreter::serve(listener, interp));
}

/// Points stdout and stderr at the kernel log.
fn log_to_kmsg() {
    use std::os::fd::AsRawFd;
    match std::fs::OpenOptions::new().write(true).open("/dev/kmsg") {
        Ok(f) => {
            // SAFETY: dup2 onto the standard descriptors; `f` stays open until both are done.
            unsafe {
                libc::dup2(f.as_raw_fd(), 1);
                libc::dup2(f.as_raw_fd(), 2);
            }
        }
        Err(e) => tracing::warn!("/dev/kmsg: {e}"),
    }
}

fn run(cli: &Cli, is_init: bool) -> anyhow::Result<()> {
    let mut cfg = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) if is_init => {
            tracing::error!("{e}; using defaults");
            Config::default()
        }
        Err(e) => return Err(e).context("loading config"),
    };
    let mut vsock_init = None;
    if is_init {
        init::run(&cfg);
        vsock_init = std::fs::read_to_string("/proc/cmdline")
            .ok()
            .and_then(|c| vsock_init::port_from_cmdline(&c));
        if vsock_init.is_some() {
            // In a microVM the console is a UART that a restored copy may not have: an
            // interrupt-driven tty write would then block forever, printk (polled) does not.
            log_to_kmsg();
        }
    }
    if let Some(p) = cli.interpreter_port {
        cfg.interpreter.enabled = true;
        cfg.interpreter.port = p;
    }
    let default_user = match &cli.default_user {
        Some(u) => {
            if users::lookup(u).is_none() {
                tracing::warn!("default user {u:?} does not exist (yet)");
            }
            u.clone()
        }
        None if users::lookup("user").is_some() => "user".into(),
        None => users::current().name,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(64)
        .thread_keep_alive(std::time::Duration::from_secs(10))
        .build()
        .context("building the runtime")?;
    rt.block_on(async {
        // The reaper must exist before the first child is spawned.
        tokio::spawn(reaper::run());
        let listener = tokio::net::TcpListener::bind(&cli.addr)
            .await
            .with_context(|| format!("binding {}", cli.addr))?;
        let local = listener.local_addr().context("local address")?;
        tracing::info!(
            addr = %local,
            version = version::ENVD_VERSION,
            init = is_init,
            default_user = %default_user,
            "cube-agent serving envd"
        );
        let state = AgentState::new(default_user, is_init);
        if cfg.interpreter.enabled {
            start_interpreter(&cfg.interpreter, state.clone()).await;
        }
        if let Some(port) = vsock_init {
            // After the listener is bound and start-up work is counted in `warming`: the host
            // snapshots templates at the first `redy`, which waits for that work.
            vsock_init::spawn(state.clone(), port);
        }
        server::serve(listener, state).await;
        Ok::<(), anyhow::Error>(())
    })
}
