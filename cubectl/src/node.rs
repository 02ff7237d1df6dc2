//! `cubectl node list|cordon|uncordon|drain`.

use crate::client::{Master, StatusExt};
use crate::output::{self, Table};
use clap::Subcommand;
use cube_proto::master::v1 as pb;
use serde_json::json;

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// Lists the nodes the master knows.
    List,
    /// Stops scheduling new sandboxes onto a node (running ones stay).
    Cordon { id: String },
    /// Lets a cordoned node take new sandboxes again.
    Uncordon { id: String },
    /// Cordons a node and pauses (or with --kill, kills) every sandbox on it.
    Drain {
        id: String,
        /// Kill the sandboxes instead of pausing them.
        #[arg(long)]
        kill: bool,
    },
}

pub fn node_json(n: &pb::NodeInfo) -> serde_json::Value {
    json!({
        "id": n.node_id, "address": n.address, "status": n.status, "runtime": n.runtime,
        "isolation": cube_proto::isolation::of(&n.runtime),
        "sandboxes": n.sandboxes, "maxSandboxes": n.max_sandboxes, "templates": n.templates,
        "cordoned": n.cordoned, "version": n.version, "kvmKind": n.kvm_kind, "vcpus": n.vcpus,
        "memoryMib": n.memory_mib, "diskFreeMib": n.disk_free_mib, "lastSeenMs": n.last_seen_ms,
        "origin": n.origin,
    })
}

pub fn print_nodes(nodes: &[pb::NodeInfo]) {
    let mut t = Table::new(&[
        "ID",
        "ADDRESS",
        "STATUS",
        "RUNTIME",
        "SANDBOXES",
        "KVM",
        "TEMPLATES",
    ]);
    for n in nodes {
        let status = if n.cordoned {
            format!("{},cordoned", n.status)
        } else {
            n.status.clone()
        };
        let sbx = if n.max_sandboxes > 0 {
            format!("{}/{}", n.sandboxes, n.max_sandboxes)
        } else {
            n.sandboxes.to_string()
        };
        t.row(vec![
            n.node_id.clone(),
            n.address.clone(),
            status,
            format!("{} ({})", n.runtime, cube_proto::isolation::of(&n.runtime)),
            sbx,
            if n.kvm_kind.is_empty() {
                "-".into()
            } else {
                n.kvm_kind.clone()
            },
            output::list(&n.templates),
        ]);
    }
    t.print();
}

pub async fn list(m: &mut Master) -> anyhow::Result<Vec<pb::NodeInfo>> {
    Ok(m.list_nodes(pb::ListNodesRequest {})
        .await
        .ctx("listing nodes")?
        .nodes)
}

pub async fn run(cmd: NodeCmd, m: &mut Master, as_json: bool) -> anyhow::Result<()> {
    let nref = |id: &str| pb::NodeRef {
        node_id: id.to_string(),
    };
    match cmd {
        NodeCmd::List => {
            let nodes = list(m).await?;
            if as_json {
                output::json(&nodes.iter().map(node_json).collect());
            } else {
                print_nodes(&nodes);
            }
        }
        NodeCmd::Cordon { id } => {
            let n = m
                .cordon_node(nref(&id))
                .await
                .ctx(format!("cordoning node {id}"))?;
            if as_json {
                output::json(&node_json(&n));
            } else {
                println!(
                    "{id} cordoned: no new sandboxes ({} running stay)",
                    n.sandboxes
                );
            }
        }
        NodeCmd::Uncordon { id } => {
            let n = m
                .uncordon_node(nref(&id))
                .await
                .ctx(format!("uncordoning node {id}"))?;
            if as_json {
                output::json(&node_json(&n));
            } else {
                println!("{id} uncordoned ({})", n.status);
            }
        }
        NodeCmd::Drain { id, kill } => {
            let r = m
                .drain_node(pb::DrainNodeRequest {
                    node_id: id.clone(),
                    kill,
                })
                .await
                .ctx(format!("draining node {id}"))?;
            let failed = r.sandboxes.iter().filter(|s| s.outcome == "error").count();
            if as_json {
                output::json(&json!({
                    "node": r.node.as_ref().map(node_json),
                    "sandboxes": r.sandboxes.iter().map(|s| json!({
                        "id": s.sandbox_id, "outcome": s.outcome, "error": s.error,
                    })).collect::<Vec<_>>(),
                }));
            } else {
                let mut t = Table::new(&["SANDBOX", "OUTCOME", "ERROR"]);
                for s in &r.sandboxes {
                    t.row(vec![
                        s.sandbox_id.clone(),
                        s.outcome.clone(),
                        s.error.clone(),
                    ]);
                }
                t.print();
                eprintln!(
                    "{id} drained: cordoned, {} sandbox(es) {}, {failed} failed",
                    r.sandboxes.len() - failed,
                    if kill { "killed" } else { "paused" }
                );
            }
            if failed > 0 {
                anyhow::bail!(
                    "draining node {id}: {failed} sandbox(es) could not be {}",
                    if kill { "killed" } else { "paused" }
                );
            }
        }
    }
    Ok(())
}
