//! cubectl: the Cube operator CLI. Sets up a single-host Cube (`up`/`down`/`status`) and manages
//! templates, sandboxes, snapshots, nodes and API keys through cube-master's gRPC API.

mod apikey;
mod cleanup;
mod client;
mod configs;
mod daemons;
mod health;
mod layout;
mod node;
mod output;
mod progress;
mod sandbox;
mod template;
mod up;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "cubectl", version, about = "Cube operator CLI")]
struct Cli {
    /// cube-master gRPC address (default: the install in --data-dir, else http://127.0.0.1:9090).
    #[arg(long, global = true, env = "CUBE_MASTER_URL")]
    master: Option<String>,
    /// Data directory of a single-host install (`up`, `down`, `status`, and where the other
    /// commands find the master).
    #[arg(long, global = true, env = "CUBE_DATA_DIR", default_value = layout::DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// Machine-readable JSON output (stable camelCase field names).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Starts cube-master, cube-api and cubelet on this host, builds `base` if missing, creates an
    /// API key and prints the E2B_* variables for the SDKs.
    Up(up::UpArgs),
    /// Stops this host's install: kills its sandboxes, stops the daemons, removes mounts,
    /// switch state and cgroups. Data stays unless --purge.
    Down {
        /// Also delete the data directory (templates, database, keys, logs).
        #[arg(long)]
        purge: bool,
    },
    /// Daemons, runtime, nodes, sandbox counts, templates and URLs of this host's install
    /// (exit status 3 when not fully up).
    Status,
    /// Templates: build, list, inspect, delete.
    Template {
        #[command(subcommand)]
        cmd: template::TemplateCmd,
    },
    /// Sandboxes: list, get, kill, pause, resume, snapshot.
    Sandbox {
        #[command(subcommand)]
        cmd: sandbox::SandboxCmd,
    },
    /// Snapshots: list, delete.
    Snapshot {
        #[command(subcommand)]
        cmd: sandbox::SnapshotCmd,
    },
    /// Nodes: list, cordon, uncordon, drain.
    Node {
        #[command(subcommand)]
        cmd: node::NodeCmd,
    },
    /// Same as `node list`.
    #[command(hide = true)]
    Nodes,
    /// API keys for the E2B API.
    Apikey {
        #[command(subcommand)]
        cmd: apikey::ApiKeyCmd,
    },
    /// One-time tokens for new nodes joining this master.
    JoinToken {
        #[command(subcommand)]
        cmd: apikey::JoinTokenCmd,
    },
}

async fn run(cli: Cli) -> anyhow::Result<i32> {
    let url = || client::master_url(cli.master.as_deref(), &cli.data_dir);
    match cli.cmd {
        Cmd::Up(a) => up::up(&cli.data_dir, a, cli.json).await.map(|_| 0),
        Cmd::Down { purge } => up::down(&cli.data_dir, purge, cli.json).await.map(|_| 0),
        Cmd::Status => up::status(&cli.data_dir, cli.json).await,
        Cmd::Template { cmd } => {
            // Check the arguments before connecting, so that a bad recipe says so.
            if let template::TemplateCmd::Build(a) = &cmd {
                template::recipe(a)?;
            }
            let mut m = client::connect(&url()).await?;
            template::run(cmd, &mut m, cli.json).await.map(|_| 0)
        }
        Cmd::Sandbox { cmd } => {
            let mut m = client::connect(&url()).await?;
            sandbox::run(cmd, &mut m, cli.json).await.map(|_| 0)
        }
        Cmd::Snapshot { cmd } => {
            let mut m = client::connect(&url()).await?;
            sandbox::run_snapshot(cmd, &mut m, cli.json)
                .await
                .map(|_| 0)
        }
        Cmd::Node { cmd } => {
            let mut m = client::connect(&url()).await?;
            node::run(cmd, &mut m, cli.json).await.map(|_| 0)
        }
        Cmd::Nodes => {
            let mut m = client::connect(&url()).await?;
            node::run(node::NodeCmd::List, &mut m, cli.json)
                .await
                .map(|_| 0)
        }
        Cmd::Apikey { cmd } => {
            let mut m = client::connect(&url()).await?;
            apikey::run(cmd, &mut m, cli.json).await.map(|_| 0)
        }
        Cmd::JoinToken { cmd } => {
            let mut m = client::connect(&url()).await?;
            apikey::run_join_token(cmd, &mut m, cli.json)
                .await
                .map(|_| 0)
        }
    }
}

fn main() {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cubectl: starting the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = match rt.block_on(run(cli)) {
        Ok(c) => c,
        Err(e) => {
            // One line: the error and its causes.
            eprintln!("cubectl: {}", format!("{e:#}").replace('\n', " "));
            1
        }
    };
    // Do not wait for lingering connections or blocking probes.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    std::process::exit(code);
}
