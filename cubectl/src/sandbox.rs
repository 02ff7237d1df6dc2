//! `cubectl sandbox list|get|kill|pause|resume|snapshot` and `cubectl snapshot list|rm`.

use crate::client::{Master, StatusExt};
use crate::output::{self, Table};
use clap::Subcommand;
use cube_proto::master::v1 as pb;
use serde_json::json;
use std::collections::HashMap;

#[derive(Subcommand, Debug)]
pub enum SandboxCmd {
    /// Lists sandboxes (all pages).
    List {
        /// creating, running, pausing, paused, resuming, killing, killed, failed (repeatable;
        /// default running and paused).
        #[arg(long)]
        state: Vec<String>,
        /// Only sandboxes whose metadata has KEY=VALUE (repeatable; all must match).
        #[arg(long, value_parser = parse_kv)]
        metadata: Vec<(String, String)>,
        /// Only sandboxes of this template.
        #[arg(long, default_value = "")]
        template: String,
        /// Stop after this many sandboxes.
        #[arg(long, default_value_t = 10_000)]
        limit: usize,
    },
    /// Shows one sandbox.
    Get { id: String },
    /// Kills a sandbox.
    Kill { id: String },
    /// Pauses a running sandbox.
    Pause {
        id: String,
        /// Keep only its filesystem: its processes end, and a resume starts it afresh.
        #[arg(long)]
        filesystem_only: bool,
    },
    /// Resumes a paused sandbox (or extends a running one's timeout).
    Resume {
        id: String,
        /// New timeout from now, in seconds.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        /// Start it afresh from its disk, its memory dropped.
        #[arg(long)]
        reboot: bool,
    },
    /// Snapshots a sandbox into a template that new sandboxes can start from.
    Snapshot {
        id: String,
        /// A name for the snapshot (the id is generated).
        #[arg(long, default_value = "")]
        name: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum SnapshotCmd {
    /// Lists snapshots.
    List {
        /// Only snapshots of this sandbox.
        #[arg(long, default_value = "")]
        sandbox: String,
    },
    /// Deletes a snapshot (by id or name).
    Rm { id: String },
}

pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

pub fn sandbox_json(s: &pb::SandboxInfo) -> serde_json::Value {
    json!({
        "id": s.sandbox_id, "team": s.team_id, "template": s.template, "build": s.build,
        "state": s.state, "reason": s.reason, "node": s.node_id, "agent": s.agent_address,
        "runtime": s.runtime, "isolation": cube_proto::isolation::of(&s.runtime),
        "envdVersion": s.envd_version, "startedAtMs": s.started_at_ms,
        "endAtMs": s.end_at_ms, "vcpus": s.vcpus, "memoryMib": s.memory_mib,
        "diskMib": s.disk_mib, "metadata": s.metadata,
    })
}

pub fn snapshot_json(s: &pb::SnapshotInfo) -> serde_json::Value {
    json!({
        "id": s.snapshot_id, "names": s.names, "sandbox": s.sandbox_id, "team": s.team_id,
        "node": s.node_id, "template": s.template, "build": s.build,
        "createdAtMs": s.created_at_ms, "filesystemOnly": s.filesystem_only,
    })
}

/// Every sandbox matching the filters, following the master's paging.
pub async fn list_all(
    m: &mut Master,
    states: Vec<String>,
    metadata: HashMap<String, String>,
    template: String,
    limit: usize,
) -> anyhow::Result<Vec<pb::SandboxInfo>> {
    let mut out = Vec::new();
    let mut next_token = String::new();
    loop {
        let r = m
            .list_sandboxes(pb::ListSandboxesRequest {
                states: states.clone(),
                metadata: metadata.clone(),
                template: template.clone(),
                limit: 100,
                next_token: next_token.clone(),
                ..Default::default()
            })
            .await
            .ctx("listing sandboxes")?;
        out.extend(r.sandboxes);
        if r.next_token.is_empty() || out.len() >= limit {
            break;
        }
        if r.next_token == next_token {
            anyhow::bail!("listing sandboxes: the master returned the same page token twice");
        }
        next_token = r.next_token;
    }
    out.truncate(limit);
    Ok(out)
}

fn print_one(s: &pb::SandboxInfo, as_json: bool) {
    if as_json {
        output::json(&sandbox_json(s));
        return;
    }
    let mut t = Table::new(&["FIELD", "VALUE"]);
    let meta: Vec<String> = {
        let mut v: Vec<_> = s.metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
        v.sort();
        v
    };
    for (k, v) in [
        ("id", s.sandbox_id.clone()),
        ("state", s.state.clone()),
        ("reason", s.reason.clone()),
        ("template", s.template.clone()),
        ("build", s.build.clone()),
        ("team", s.team_id.clone()),
        ("node", s.node_id.clone()),
        ("runtime", s.runtime.clone()),
        (
            "isolation",
            cube_proto::isolation::of(&s.runtime).to_string(),
        ),
        ("agent", s.agent_address.clone()),
        ("shape", format!("{} vCPU, {} MiB", s.vcpus, s.memory_mib)),
        ("started", output::time_ms(s.started_at_ms)),
        ("ends", output::time_ms(s.end_at_ms)),
        ("metadata", output::list(&meta)),
    ] {
        if !v.is_empty() {
            t.row(vec![k.into(), v]);
        }
    }
    t.print();
}

pub async fn run(cmd: SandboxCmd, m: &mut Master, as_json: bool) -> anyhow::Result<()> {
    match cmd {
        SandboxCmd::List {
            state,
            metadata,
            template,
            limit,
        } => {
            let v = list_all(m, state, metadata.into_iter().collect(), template, limit).await?;
            if as_json {
                output::json(&v.iter().map(sandbox_json).collect());
            } else {
                let mut t = Table::new(&["ID", "TEMPLATE", "STATE", "NODE", "STARTED", "ENDS"]);
                for s in &v {
                    t.row(vec![
                        s.sandbox_id.clone(),
                        s.template.clone(),
                        s.state.clone(),
                        s.node_id.clone(),
                        output::time_ms(s.started_at_ms),
                        output::time_ms(s.end_at_ms),
                    ]);
                }
                t.print();
            }
        }
        SandboxCmd::Get { id } => {
            let s = m
                .get_sandbox(sref(&id))
                .await
                .ctx(format!("sandbox {id}"))?;
            print_one(&s, as_json);
        }
        SandboxCmd::Kill { id } => {
            let r = m
                .kill_sandbox(sref(&id))
                .await
                .ctx(format!("killing sandbox {id}"))?;
            if !r.existed {
                anyhow::bail!("no sandbox {id} (unknown, or killed already)");
            }
            if as_json {
                output::json(&json!({"id": id, "killed": true}));
            } else {
                println!("killed {id}");
            }
        }
        SandboxCmd::Pause {
            id,
            filesystem_only,
        } => {
            let s = m
                .pause_sandbox(pb::PauseSandboxRequest {
                    team_id: String::new(),
                    sandbox_id: id.clone(),
                    require_healthy_guest: false,
                    filesystem_only,
                })
                .await
                .ctx(format!("pausing sandbox {id}"))?;
            if as_json {
                output::json(&sandbox_json(&s));
            } else {
                println!("{id} {}", s.state);
            }
        }
        SandboxCmd::Resume {
            id,
            timeout,
            reboot,
        } => {
            if timeout == 0 {
                anyhow::bail!("--timeout must be at least 1 second");
            }
            let r = m
                .connect_sandbox(pb::ConnectSandboxRequest {
                    team_id: String::new(),
                    sandbox_id: id.clone(),
                    timeout_s: timeout,
                    reboot,
                })
                .await
                .ctx(format!("resuming sandbox {id}"))?;
            let s = r.sandbox.unwrap_or_default();
            if as_json {
                let mut v = sandbox_json(&s);
                v["resumed"] = json!(r.resumed);
                output::json(&v);
            } else if r.resumed {
                println!(
                    "{id} resumed ({}), ends {} UTC",
                    s.state,
                    output::time_ms(s.end_at_ms)
                );
            } else {
                println!(
                    "{id} was not paused ({}); ends {} UTC",
                    s.state,
                    output::time_ms(s.end_at_ms)
                );
            }
        }
        SandboxCmd::Snapshot { id, name } => {
            let s = m
                .snapshot_sandbox(pb::SnapshotSandboxRequest {
                    team_id: String::new(),
                    sandbox_id: id.clone(),
                    name,
                })
                .await
                .ctx(format!("snapshotting sandbox {id}"))?;
            if as_json {
                output::json(&snapshot_json(&s));
            } else {
                println!("{}", s.snapshot_id);
                eprintln!(
                    "snapshot of {id}{}; create sandboxes from it with template {}",
                    if s.filesystem_only {
                        " (filesystem only: namespace runtime)"
                    } else {
                        ""
                    },
                    s.snapshot_id
                );
            }
        }
    }
    Ok(())
}

pub async fn run_snapshot(cmd: SnapshotCmd, m: &mut Master, as_json: bool) -> anyhow::Result<()> {
    match cmd {
        SnapshotCmd::List { sandbox } => {
            let mut all = Vec::new();
            let mut next_token = String::new();
            loop {
                let r = m
                    .list_snapshots(pb::ListSnapshotsRequest {
                        sandbox_id: sandbox.clone(),
                        limit: 100,
                        next_token: next_token.clone(),
                        ..Default::default()
                    })
                    .await
                    .ctx("listing snapshots")?;
                all.extend(r.snapshots);
                if r.next_token.is_empty() || r.next_token == next_token {
                    break;
                }
                next_token = r.next_token;
            }
            if as_json {
                output::json(&all.iter().map(snapshot_json).collect());
            } else {
                let mut t = Table::new(&["ID", "NAMES", "SANDBOX", "TEMPLATE", "NODE", "CREATED"]);
                for s in &all {
                    t.row(vec![
                        s.snapshot_id.clone(),
                        output::list(&s.names[s.names.len().min(1)..]),
                        s.sandbox_id.clone(),
                        s.template.clone(),
                        s.node_id.clone(),
                        output::time_ms(s.created_at_ms),
                    ]);
                }
                t.print();
            }
        }
        SnapshotCmd::Rm { id } => {
            let r = m
                .delete_snapshot(pb::DeleteSnapshotRequest {
                    team_id: String::new(),
                    snapshot_id: id.clone(),
                })
                .await
                .ctx(format!("deleting snapshot {id}"))?;
            if !r.existed {
                anyhow::bail!("no snapshot {id}");
            }
            if as_json {
                output::json(&json!({"id": id, "deleted": true}));
            } else {
                println!("deleted {id}");
            }
        }
    }
    Ok(())
}

fn sref(id: &str) -> pb::SandboxRef {
    pb::SandboxRef {
        team_id: String::new(),
        sandbox_id: id.to_string(),
    }
}
