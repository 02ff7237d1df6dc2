//! cubectl: operator CLI talking to cube-master's gRPC API.

use anyhow::Context;
use clap::{Parser, Subcommand};
use cube_proto::master::v1 as pb;
use cube_proto::master::v1::master_client::MasterClient;
use serde_json::json;

#[derive(Parser)]
#[command(name = "cubectl", about = "Cube operator CLI")]
struct Cli {
    /// cube-master gRPC address.
    #[arg(long, env = "CUBE_MASTER_URL", default_value = "http://127.0.0.1:9090")]
    master: String,
    /// Machine-readable output.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// API keys.
    Apikey {
        #[command(subcommand)]
        cmd: ApiKeyCmd,
    },
    /// Sandboxes.
    Sandbox {
        #[command(subcommand)]
        cmd: SandboxCmd,
    },
    /// Nodes known to the master.
    Nodes,
}

#[derive(Subcommand)]
enum ApiKeyCmd {
    /// Creates a key and prints it (shown only once).
    Create {
        #[arg(long, default_value = "default")]
        name: String,
        #[arg(long, default_value = "")]
        team: String,
    },
    List,
    Revoke {
        id: String,
    },
}

#[derive(Subcommand)]
enum SandboxCmd {
    List {
        /// running, paused, killed, failed, ... (repeatable; default running+paused).
        #[arg(long)]
        state: Vec<String>,
    },
    Kill {
        id: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut m = MasterClient::connect(cli.master.clone())
        .await
        .with_context(|| format!("connecting to cube-master at {}", cli.master))?;
    match cli.cmd {
        Cmd::Apikey { cmd } => match cmd {
            ApiKeyCmd::Create { name, team } => {
                let r = m
                    .create_api_key(pb::CreateApiKeyRequest {
                        name,
                        team_id: team,
                    })
                    .await?
                    .into_inner();
                let k = r.key.unwrap_or_default();
                if cli.json {
                    println!(
                        "{}",
                        json!({"id": k.id, "name": k.name, "team": k.team_id, "key": r.secret})
                    );
                } else {
                    println!("{}", r.secret);
                    eprintln!("created key {} ({}); it is not shown again", k.id, k.name);
                }
            }
            ApiKeyCmd::List => {
                let r = m
                    .list_api_keys(pb::ListApiKeysRequest {})
                    .await?
                    .into_inner();
                if cli.json {
                    let v: Vec<_> = r
                        .keys
                        .iter()
                        .map(|k| json!({"id": k.id, "name": k.name, "team": k.team_id, "prefix": k.prefix, "createdAtMs": k.created_at_ms, "revoked": k.revoked}))
                        .collect();
                    println!("{}", serde_json::Value::Array(v));
                } else {
                    println!(
                        "{:<16} {:<20} {:<12} {:<14} REVOKED",
                        "ID", "NAME", "TEAM", "PREFIX"
                    );
                    for k in r.keys {
                        println!(
                            "{:<16} {:<20} {:<12} {:<14} {}",
                            k.id, k.name, k.team_id, k.prefix, k.revoked
                        );
                    }
                }
            }
            ApiKeyCmd::Revoke { id } => {
                let r = m
                    .revoke_api_key(pb::RevokeApiKeyRequest { id: id.clone() })
                    .await?
                    .into_inner();
                if cli.json {
                    println!("{}", json!({"id": id, "revoked": r.existed}));
                } else if r.existed {
                    println!("revoked {id}");
                } else {
                    anyhow::bail!("no active key {id}");
                }
            }
        },
        Cmd::Sandbox { cmd } => match cmd {
            SandboxCmd::List { state } => {
                let r = m
                    .list_sandboxes(pb::ListSandboxesRequest {
                        states: state,
                        limit: 100,
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                if cli.json {
                    let v: Vec<_> = r
                        .sandboxes
                        .iter()
                        .map(|s| json!({"id": s.sandbox_id, "team": s.team_id, "template": s.template, "state": s.state, "node": s.node_id, "agent": s.agent_address, "startedAtMs": s.started_at_ms, "endAtMs": s.end_at_ms, "metadata": s.metadata}))
                        .collect();
                    println!("{}", serde_json::Value::Array(v));
                } else {
                    println!(
                        "{:<22} {:<12} {:<10} {:<24} NODE",
                        "ID", "TEMPLATE", "STATE", "AGENT"
                    );
                    for s in r.sandboxes {
                        println!(
                            "{:<22} {:<12} {:<10} {:<24} {}",
                            s.sandbox_id, s.template, s.state, s.agent_address, s.node_id
                        );
                    }
                }
            }
            SandboxCmd::Kill { id } => {
                let r = m
                    .kill_sandbox(pb::SandboxRef {
                        team_id: String::new(),
                        sandbox_id: id.clone(),
                    })
                    .await?
                    .into_inner();
                if cli.json {
                    println!("{}", json!({"id": id, "killed": r.existed}));
                } else if r.existed {
                    println!("killed {id}");
                } else {
                    anyhow::bail!("no sandbox {id}");
                }
            }
        },
        Cmd::Nodes => {
            let r = m.list_nodes(pb::ListNodesRequest {}).await?.into_inner();
            if cli.json {
                let v: Vec<_> = r
                    .nodes
                    .iter()
                    .map(|n| json!({"id": n.node_id, "address": n.address, "status": n.status, "runtime": n.runtime, "sandboxes": n.sandboxes, "templates": n.templates}))
                    .collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                for n in r.nodes {
                    println!(
                        "{} {} {} {} sandboxes={} templates={:?}",
                        n.node_id, n.address, n.status, n.runtime, n.sandboxes, n.templates
                    );
                }
            }
        }
    }
    Ok(())
}
