//! `cubelet`: the node daemon.

use anyhow::Context;
use clap::{Parser, Subcommand};
use cubelet::config::{Config, SwitchKind};
use cubelet::template::{BuildEvent, Source, TemplateStore};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "cubelet",
    version,
    about = "Cube node daemon: templates, storage, network, pools and sandboxes"
)]
struct Cli {
    /// Configuration file (default /etc/cube/cubelet.toml; missing = all defaults).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Log filter (tracing env-filter syntax); RUST_LOG overrides.
    #[arg(long, global = true, default_value = "info")]
    log: String,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon (the default).
    Run {
        /// Kill all sandboxes on exit instead of leaving them for the next cubelet to re-adopt.
        #[arg(long)]
        kill_sandboxes_on_exit: bool,
    },
    /// Build a template into the data directory (no daemon needed).
    BuildTemplate {
        name: String,
        /// Debian suite for debootstrap (with --packages).
        #[arg(long, conflicts_with_all = ["oci", "dir"])]
        debootstrap: Option<String>,
        /// Extra packages for debootstrap, comma separated.
        #[arg(long, value_delimiter = ',')]
        packages: Vec<String>,
        #[arg(long, default_value = "http://deb.debian.org/debian")]
        mirror: String,
        /// OCI image layout directory or docker save tarball.
        #[arg(long, conflicts_with = "dir")]
        oci: Option<PathBuf>,
        /// Root filesystem directory.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Extra free space in the image, MiB.
        #[arg(long, default_value_t = 0)]
        extra_mib: u64,
    },
    /// Assemble a minimal root directory from host binaries (shell + coreutils) for fast templates.
    HostRoot {
        dst: PathBuf,
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,touch,sync,true,false,head,grep"
        )]
        programs: Vec<String>,
    },
    /// Print the default configuration as TOML.
    DefaultConfig,
}

fn main() {
    // The sandbox launchers must run before any thread exists (they fork).
    match std::env::args().nth(1).as_deref() {
        Some("sandbox-init") => std::process::exit(cubelet::runtime::namespace::init::main()),
        Some("gvisor-init") => std::process::exit(cubelet::runtime::gvisor::init::main()),
        _ => {}
    }
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // The log format comes from the config; a config that does not load is reported by
    // real_main, in text.
    let json = Config::load(cli.config.as_deref())
        .is_ok_and(|c| c.log_format == cube_proto::logging::LogFormat::Json);
    if json {
        fmt.json().init();
    } else {
        fmt.init();
    }
    if let Err(e) = real_main(cli) {
        eprintln!("cubelet: {e:#}");
        std::process::exit(1);
    }
}

fn real_main(cli: Cli) -> anyhow::Result<()> {
    let cfg = Config::load(cli.config.as_deref())?;
    match cli.cmd.unwrap_or(Cmd::Run {
        kill_sandboxes_on_exit: false,
    }) {
        Cmd::DefaultConfig => {
            print!("{}", toml::to_string_pretty(&Config::default())?);
            Ok(())
        }
        Cmd::HostRoot { dst, programs } => {
            let p: Vec<&str> = programs.iter().map(|s| s.as_str()).collect();
            cubelet::template::host_minimal_root(&dst, &p)
                .with_context(|| format!("assembling {}", dst.display()))
        }
        Cmd::BuildTemplate {
            name,
            debootstrap,
            packages,
            mirror,
            oci,
            dir,
            extra_mib,
        } => {
            let source = match (debootstrap, oci, dir) {
                (Some(suite), _, _) => Source::Debootstrap {
                    suite,
                    packages,
                    mirror,
                },
                (_, Some(p), _) => Source::Oci { path: p },
                (_, _, Some(p)) => Source::Directory { path: p },
                _ if name == "base" => Source::base(),
                _ => anyhow::bail!(
                    "give one of --debootstrap, --oci or --dir (only `base` has a default recipe)"
                ),
            };
            if let Some(img) = &cfg.storage.xfs_loop_image {
                cubelet::storage::ensure_xfs_loop(
                    img,
                    cfg.storage.xfs_loop_size_gib << 30,
                    &cfg.data_dir,
                )
                .context("XFS loop image for the data directory")?;
            }
            let store = TemplateStore::new(
                &cfg.data_dir.join("templates"),
                &cfg.cache_dir,
                &cfg.agent_binary,
            )?;
            let progress = |e: BuildEvent| match e {
                BuildEvent::Phase(p) => eprintln!("==> {p}"),
                BuildEvent::Log(l) => eprintln!("    {l}"),
                BuildEvent::Reused => eprintln!("==> same inputs as an existing build: reused"),
                BuildEvent::Done { bytes } => eprintln!("==> done ({} MiB image)", bytes >> 20),
            };
            let (m, _) = store.build(&name, &source, extra_mib, &progress)?;
            println!("{}", serde_json::to_string_pretty(&m)?);
            Ok(())
        }
        Cmd::Run {
            kill_sandboxes_on_exit,
        } => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let grpc: std::net::SocketAddr = cfg
                    .grpc_addr
                    .parse()
                    .with_context(|| format!("grpc_addr {:?}", cfg.grpc_addr))?;
                cube_proto::tls::check_listen(grpc, cfg.tls.as_ref()).context("grpc_addr")?;
                let http: std::net::SocketAddr = cfg
                    .http_addr
                    .parse()
                    .with_context(|| format!("http_addr {:?}", cfg.http_addr))?;
                let mut proxy_names = None;
                let hook: Arc<dyn cubelet::network::NetworkHook> = match cfg.network.switch {
                    SwitchKind::CubeVs => {
                        // The proxy listens before the switch opens: its port is the DNAT target.
                        let mut sw = cfg.switch.clone();
                        let names = match cfg.network.egress_proxy {
                            Some(ip) => {
                                let reg = Arc::new(cubelet::egress_proxy::Registry::default());
                                let proxy = cubelet::egress_proxy::EgressProxy::bind(
                                    ip,
                                    cfg.network.dns_resolver,
                                    reg.clone(),
                                )
                                .await
                                .with_context(|| format!("starting the egress proxy on {ip} (network.egress_proxy)"))?;
                                sw.egress_proxy = Some(proxy.local_addr()?);
                                tracing::info!(addr = ?sw.egress_proxy, "egress proxy listening");
                                tokio::spawn(proxy.run());
                                proxy_names = Some(reg.clone());
                                Some(reg)
                            }
                            None => None,
                        };
                        Arc::new(
                            cubelet::vswitch::VsHook::open(
                                sw,
                                cfg.sandbox.agent_port,
                                cfg.network.dns_resolver,
                                names,
                            )
                            .context("starting cube-vs (set network.switch = \"none\" to run without isolation)")?,
                        )
                    }
                    SwitchKind::None => {
                        for _ in 0..3 {
                            tracing::error!("network.switch = \"none\": SANDBOXES ARE NOT ISOLATED. They can reach every host service (this cubelet's gRPC included), each other and the cloud metadata address, and network policies are NOT enforced. Never run untrusted code like this.");
                        }
                        Arc::new(cubelet::network::NoSwitch)
                    }
                };
                // The master link uses the same fleet identity as the gRPC server.
                cube_proto::tls::set_process_tls(cfg.tls.clone()).context("[tls]")?;
                let node = cubelet::node::Node::start(cfg, hook).await?;
                if let Some(reg) = proxy_names {
                    node.host
                        .metrics
                        .registry
                        .register(Box::new(reg.connections.clone()))
                        .context("registering the egress proxy's metrics")?;
                }
                node.spawn_refiller();
                node.spawn_sampler();
                // `[master] address` set: register and heartbeat (never fatal).
                let registration = cubelet::registration::spawn(node.clone());
                let stop = async {
                    let mut term =
                        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                            .expect("SIGTERM handler");
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                };
                cubelet::server::serve(node.clone(), grpc, http, stop).await?;
                if let Some(r) = registration {
                    r.abort();
                }
                tracing::info!(kill_sandboxes_on_exit, "shutting down");
                node.shutdown(kill_sandboxes_on_exit).await;
                Ok(())
            })
        }
    }
}
