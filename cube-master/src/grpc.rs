//! The `cube.master.v1.Master` gRPC service over a [`Controller`](crate::ops::Controller),
//! and the conversions between the master's protocol and the domain (rows, nodes, errors):
//! the only module that speaks `cube.master.v1` to clients.

use crate::apikey;
use crate::error::MasterError;
use crate::fleet::Node;
use crate::ops::templates::EventStream;
use crate::ops::{Controller, CreateParams, ListParams};
use crate::state::SandboxState;
use crate::store::apikeys::ApiKeyRow;
use crate::store::secrets::SecretRow;
use crate::store::snapshots::SnapshotRow;
use crate::store::{decode_map, SandboxRow};
use cube_proto::master::v1 as pb;
use cube_proto::master::v1::master_server::{Master, MasterServer};
use std::str::FromStr;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct MasterService {
    ctl: Arc<Controller>,
}

impl MasterService {
    pub fn new(ctl: Arc<Controller>) -> MasterServer<MasterService> {
        MasterServer::new(MasterService { ctl })
    }
}

/// Runs a state-changing operation to its end in a task of its own. A client that goes away
/// (cube-api restarted, a deadline) drops the handler's future; an operation cut short there
/// would leave its sandbox in a passing state (`creating`, `killing`, `pausing`) for good.
async fn to_end<T: Send + 'static>(
    op: impl std::future::Future<Output = Result<T, MasterError>> + Send + 'static,
) -> Result<T, MasterError> {
    tokio::spawn(op)
        .await
        .map_err(|e| MasterError::Internal(format!("operation task: {e}")))?
}

pub fn to_info(ctl: &Controller, r: &SandboxRow) -> pb::SandboxInfo {
    pb::SandboxInfo {
        sandbox_id: r.id.clone(),
        team_id: r.team_id.clone(),
        template: r.template.clone(),
        build: r.build.clone(),
        state: r.state.as_str().into(),
        reason: r.reason.clone(),
        node_id: r.node_id.clone(),
        agent_address: r.agent_address.clone(),
        host_interface: r.host_interface.clone(),
        access_token: ctl.access_token(r),
        envd_version: r.envd_version.clone(),
        metadata: r.metadata_map().into_iter().collect(),
        started_at_ms: r.started_at_ms,
        end_at_ms: r.end_at_ms,
        vcpus: r.vcpus.max(0) as u32,
        memory_mib: r.memory_mib.max(0) as u64,
        disk_mib: r.disk_mib.max(0) as u64,
        runtime: r.runtime.clone(),
        auto_pause: r.auto_pause == 1,
        auto_resume: r.auto_resume == 1,
        allow_internet: r.internet(),
        timeout_s: r.timeout_s.max(0) as u64,
        private_ports: r.private_ports == 1,
        mask_request_host: r.mask_request_host.clone(),
        allow_out: crate::egress::Rules::decode(&r.allow_out),
        deny_out: crate::egress::Rules::decode(&r.deny_out),
        dns_servers: crate::egress::Rules::decode_dns(r.dns_servers.as_deref())
            .map(|servers| pb::DnsServers { servers }),
        // A sandbox paused before the mode was recorded kept its memory.
        pause_mode: match (r.state.as_str(), r.pause_mode.as_str()) {
            ("paused" | "pausing", "") => "full".into(),
            ("paused" | "pausing", m) => m.into(),
            _ => String::new(),
        },
        auto_pause_filesystem: r.auto_pause_filesystem == 1,
    }
}

fn key_info(k: &ApiKeyRow) -> pb::ApiKey {
    pb::ApiKey {
        id: k.id.clone(),
        name: k.name.clone(),
        team_id: k.team_id.clone(),
        prefix: k.prefix.clone(),
        created_at_ms: k.created_at_ms,
        revoked: k.revoked != 0,
    }
}

/// The SnapshotInfo of a snapshot row.
pub fn snapshot_info(s: &SnapshotRow) -> pb::SnapshotInfo {
    let mut names = vec![s.id.clone()];
    if !s.name.is_empty() {
        names.push(s.name.clone());
    }
    pb::SnapshotInfo {
        snapshot_id: s.id.clone(),
        names,
        sandbox_id: s.sandbox_id.clone(),
        team_id: s.team_id.clone(),
        node_id: s.node_id.clone(),
        template: s.template.clone(),
        build: s.build.clone(),
        created_at_ms: s.created_at_ms,
        filesystem_only: s.filesystem_only != 0,
    }
}

/// The SecretInfo of a secret row (never its value).
pub fn secret_info(s: &SecretRow) -> pb::SecretInfo {
    pb::SecretInfo {
        secret_id: s.id.clone(),
        team_id: s.team_id.clone(),
        name: s.name.clone(),
        current_version: s.version,
        metadata: decode_map(&s.metadata).into_iter().collect(),
        created_at_ms: s.created_at_ms,
        updated_at_ms: s.updated_at_ms,
    }
}

/// The NodeInfo of an in-memory node.
pub fn node_info(n: &Node) -> pb::NodeInfo {
    let s = n.status.clone().unwrap_or_default();
    let cap = s.capacity.unwrap_or_default();
    pb::NodeInfo {
        node_id: n.id(),
        address: n.address.clone(),
        status: if n.ready { "ready" } else { "not_ready" }.into(),
        runtime: s.runtime,
        sandboxes: s.sandboxes,
        templates: s.templates,
        max_sandboxes: cap.max_sandboxes,
        cordoned: n.cordoned,
        version: s.version,
        kvm_kind: s.kvm_kind,
        vcpus: cap.vcpus,
        memory_mib: cap.memory_mib,
        disk_free_mib: cap.disk_free_mib,
        last_seen_ms: n.last_seen_ms,
        origin: n.origin.as_str().into(),
    }
}

/// All nodes as NodeInfos, sorted by id.
pub fn node_infos(ctl: &Controller) -> Vec<pb::NodeInfo> {
    ctl.nodes_by_id().iter().map(node_info).collect()
}

/// gRPC code name of an error, as fork results carry it.
pub fn code_name(e: &MasterError) -> String {
    let s: tonic::Status = match e {
        MasterError::InvalidArgument(m) => tonic::Status::invalid_argument(m.clone()),
        MasterError::NotFound(m) => tonic::Status::not_found(m.clone()),
        MasterError::FailedPrecondition(m) => tonic::Status::failed_precondition(m.clone()),
        MasterError::Unauthenticated(m) => tonic::Status::unauthenticated(m.clone()),
        MasterError::ResourceExhausted(m) => tonic::Status::resource_exhausted(m.clone()),
        MasterError::Unavailable(m) => tonic::Status::unavailable(m.clone()),
        MasterError::Node { status, .. } => match status.code() {
            tonic::Code::InvalidArgument
            | tonic::Code::NotFound
            | tonic::Code::ResourceExhausted => tonic::Status::new(status.code(), ""),
            _ => tonic::Status::internal(""),
        },
        _ => tonic::Status::internal(""),
    };
    format!("{:?}", s.code())
        .chars()
        .fold(String::new(), |mut o, c| {
            if c.is_uppercase() && !o.is_empty() {
                o.push('_');
            }
            o.push(c.to_ascii_uppercase());
            o
        })
}

#[tonic::async_trait]
impl Master for MasterService {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let r = req.into_inner();
        let started = std::time::Instant::now();
        let egress = crate::egress::Rules::parse(
            &r.allow_out,
            &r.deny_out,
            r.dns_servers.as_ref().map(|d| d.servers.as_slice()),
        )?;
        let ctl = self.ctl.clone();
        let p = CreateParams {
            team_id: r.team_id,
            template: r.template,
            timeout_s: r.timeout_s,
            metadata: r.metadata.into_iter().collect(),
            env_vars: r.env_vars.into_iter().collect(),
            allow_internet: r.allow_internet,
            auto_pause: r.auto_pause,
            auto_resume: r.auto_resume,
            auto_pause_filesystem: r.auto_pause_filesystem,
            idempotency_key: r.idempotency_key,
            private_ports: r.private_ports,
            mask_request_host: r.mask_request_host,
            egress,
        };
        let res = to_end(async move { ctl.create(p).await }).await;
        let m = &self.ctl.metrics;
        let row = match res {
            Ok(row) => {
                m.create_seconds.observe(started.elapsed().as_secs_f64());
                m.creates.with_label_values(&["ok"]).inc();
                row
            }
            Err(e) => {
                m.creates.with_label_values(&["error"]).inc();
                return Err(e.into());
            }
        };
        Ok(Response::new(to_info(&self.ctl, &row)))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let r = req.into_inner();
        let row = self.ctl.get(&r.team_id, &r.sandbox_id).await?;
        Ok(Response::new(to_info(&self.ctl, &row)))
    }

    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let r = req.into_inner();
        let mut states = Vec::new();
        for s in &r.states {
            states.push(
                SandboxState::from_str(s)
                    .map_err(|e| Status::invalid_argument(format!("state: {e}")))?,
            );
        }
        let (rows, next) = self
            .ctl
            .list(ListParams {
                team_id: r.team_id,
                states,
                metadata: r.metadata.into_iter().collect(),
                limit: r.limit,
                next_token: r.next_token,
                ascending: r.ascending,
                template: r.template,
                started_after_ms: r.started_after_ms,
            })
            .await?;
        Ok(Response::new(pb::ListSandboxesResponse {
            sandboxes: rows.iter().map(|r| to_info(&self.ctl, r)).collect(),
            next_token: next,
        }))
    }

    async fn kill_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::KillSandboxResponse>, Status> {
        let r = req.into_inner();
        let ctl = self.ctl.clone();
        let existed = to_end(async move {
            ctl.kill(&r.team_id, &r.sandbox_id, "killed by request")
                .await
        })
        .await?;
        Ok(Response::new(pb::KillSandboxResponse { existed }))
    }

    async fn set_timeout(
        &self,
        req: Request<pb::SetTimeoutRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let r = req.into_inner();
        let row = self
            .ctl
            .set_timeout(&r.team_id, &r.sandbox_id, r.timeout_s, r.extend_only)
            .await?;
        Ok(Response::new(to_info(&self.ctl, &row)))
    }

    async fn update_network(
        &self,
        req: Request<pb::UpdateNetworkRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let r = req.into_inner();
        let rules = crate::egress::Rules::parse(
            &r.allow_out,
            &r.deny_out,
            r.dns_servers.as_ref().map(|d| d.servers.as_slice()),
        )?;
        let row = self
            .ctl
            .update_network(&r.team_id, &r.sandbox_id, r.allow_internet, rules)
            .await?;
        Ok(Response::new(to_info(&self.ctl, &row)))
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::PauseSandboxRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let r = req.into_inner();
        let ctl = self.ctl.clone();
        let row = to_end(async move {
            ctl.pause_with(
                &r.team_id,
                &r.sandbox_id,
                r.require_healthy_guest,
                r.filesystem_only,
            )
            .await
        })
        .await?;
        Ok(Response::new(to_info(&self.ctl, &row)))
    }

    async fn connect_sandbox(
        &self,
        req: Request<pb::ConnectSandboxRequest>,
    ) -> Result<Response<pb::ConnectSandboxResponse>, Status> {
        let r = req.into_inner();
        let ctl = self.ctl.clone();
        let (row, resumed) = to_end(async move {
            ctl.connect_with(&r.team_id, &r.sandbox_id, r.timeout_s, r.reboot)
                .await
        })
        .await?;
        Ok(Response::new(pb::ConnectSandboxResponse {
            sandbox: Some(to_info(&self.ctl, &row)),
            resumed,
        }))
    }

    async fn resolve_access_token(
        &self,
        req: Request<pb::ResolveAccessTokenRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let row = self
            .ctl
            .by_access_token(&req.into_inner().access_token)
            .await?;
        Ok(Response::new(to_info(&self.ctl, &row)))
    }

    async fn validate_api_key(
        &self,
        req: Request<pb::ValidateApiKeyRequest>,
    ) -> Result<Response<pb::ValidateApiKeyResponse>, Status> {
        let k = apikey::validate(&self.ctl.db, &req.into_inner().key).await?;
        Ok(Response::new(pb::ValidateApiKeyResponse {
            key_id: k.id,
            team_id: k.team_id,
        }))
    }

    async fn create_api_key(
        &self,
        req: Request<pb::CreateApiKeyRequest>,
    ) -> Result<Response<pb::CreateApiKeyResponse>, Status> {
        let r = req.into_inner();
        let (row, secret) = apikey::create(&self.ctl.db, &r.name, &r.team_id).await?;
        tracing::info!(key = %row.id, name = %row.name, "API key created");
        Ok(Response::new(pb::CreateApiKeyResponse {
            key: Some(key_info(&row)),
            secret,
        }))
    }

    async fn list_api_keys(
        &self,
        _req: Request<pb::ListApiKeysRequest>,
    ) -> Result<Response<pb::ListApiKeysResponse>, Status> {
        let keys = self.ctl.db.list_api_keys().await?;
        Ok(Response::new(pb::ListApiKeysResponse {
            keys: keys.iter().map(key_info).collect(),
        }))
    }

    async fn revoke_api_key(
        &self,
        req: Request<pb::RevokeApiKeyRequest>,
    ) -> Result<Response<pb::RevokeApiKeyResponse>, Status> {
        let existed = self.ctl.db.revoke_api_key(&req.into_inner().id).await?;
        Ok(Response::new(pb::RevokeApiKeyResponse { existed }))
    }

    async fn register_node(
        &self,
        req: Request<pb::RegisterNodeRequest>,
    ) -> Result<Response<pb::RegisterNodeResponse>, Status> {
        Ok(Response::new(
            self.ctl.register_node(req.into_inner()).await?,
        ))
    }
    async fn node_heartbeat(
        &self,
        req: Request<pb::NodeHeartbeatRequest>,
    ) -> Result<Response<pb::NodeHeartbeatResponse>, Status> {
        Ok(Response::new(
            self.ctl.node_heartbeat(req.into_inner()).await?,
        ))
    }
    async fn cordon_node(
        &self,
        req: Request<pb::NodeRef>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        let id = req.into_inner().node_id;
        Ok(Response::new(node_info(
            &self.ctl.set_cordon(&id, true).await?,
        )))
    }
    async fn uncordon_node(
        &self,
        req: Request<pb::NodeRef>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        let id = req.into_inner().node_id;
        Ok(Response::new(node_info(
            &self.ctl.set_cordon(&id, false).await?,
        )))
    }
    async fn drain_node(
        &self,
        req: Request<pb::DrainNodeRequest>,
    ) -> Result<Response<pb::DrainNodeResponse>, Status> {
        let r = req.into_inner();
        let d = self.ctl.drain_node(&r.node_id, r.kill).await?;
        Ok(Response::new(pb::DrainNodeResponse {
            node: Some(node_info(&d.node)),
            sandboxes: d.sandboxes,
        }))
    }
    async fn create_join_token(
        &self,
        req: Request<pb::CreateJoinTokenRequest>,
    ) -> Result<Response<pb::CreateJoinTokenResponse>, Status> {
        let (token, expires_at_ms) = self.ctl.create_join_token(req.into_inner().ttl_s).await?;
        Ok(Response::new(pb::CreateJoinTokenResponse {
            token,
            expires_at_ms,
        }))
    }
    async fn create_secret(
        &self,
        req: Request<pb::CreateSecretRequest>,
    ) -> Result<Response<pb::SecretInfo>, Status> {
        let r = req.into_inner();
        let metadata = r.metadata.into_iter().collect();
        let s = self
            .ctl
            .create_secret(&r.team_id, &r.name, &r.value, &metadata)
            .await?;
        Ok(Response::new(secret_info(&s)))
    }
    async fn list_secrets(
        &self,
        req: Request<pb::ListSecretsRequest>,
    ) -> Result<Response<pb::ListSecretsResponse>, Status> {
        let r = req.into_inner();
        let (rows, next_token) = self
            .ctl
            .list_secrets(&r.team_id, r.limit, &r.next_token)
            .await?;
        Ok(Response::new(pb::ListSecretsResponse {
            secrets: rows.iter().map(secret_info).collect(),
            next_token,
        }))
    }
    async fn get_secret(
        &self,
        req: Request<pb::SecretRef>,
    ) -> Result<Response<pb::SecretInfo>, Status> {
        let r = req.into_inner();
        let s = self.ctl.get_secret(&r.team_id, &r.secret).await?;
        Ok(Response::new(secret_info(&s)))
    }
    async fn update_secret(
        &self,
        req: Request<pb::UpdateSecretRequest>,
    ) -> Result<Response<pb::SecretInfo>, Status> {
        let r = req.into_inner();
        let metadata: std::collections::BTreeMap<String, String> = r.metadata.into_iter().collect();
        let s = self
            .ctl
            .update_secret(
                &r.team_id,
                &r.secret,
                &r.value,
                r.set_metadata.then_some(&metadata),
            )
            .await?;
        Ok(Response::new(secret_info(&s)))
    }
    async fn delete_secret(
        &self,
        req: Request<pb::SecretRef>,
    ) -> Result<Response<pb::DeleteSecretResponse>, Status> {
        let r = req.into_inner();
        self.ctl.delete_secret(&r.team_id, &r.secret).await?;
        Ok(Response::new(pb::DeleteSecretResponse {}))
    }
    async fn snapshot_sandbox(
        &self,
        req: Request<pb::SnapshotSandboxRequest>,
    ) -> Result<Response<pb::SnapshotInfo>, Status> {
        let r = req.into_inner();
        let s = self
            .ctl
            .snapshot(&r.team_id, &r.sandbox_id, &r.name)
            .await?;
        Ok(Response::new(snapshot_info(&s)))
    }
    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let (rows, next_token) = self.ctl.list_snapshots(&r).await?;
        Ok(Response::new(pb::ListSnapshotsResponse {
            snapshots: rows.iter().map(snapshot_info).collect(),
            next_token,
        }))
    }
    async fn delete_snapshot(
        &self,
        req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let r = req.into_inner();
        let existed = self.ctl.delete_snapshot(&r.team_id, &r.snapshot_id).await?;
        Ok(Response::new(pb::DeleteSnapshotResponse { existed }))
    }
    async fn fork_sandbox(
        &self,
        req: Request<pb::ForkSandboxRequest>,
    ) -> Result<Response<pb::ForkSandboxResponse>, Status> {
        let r = req.into_inner();
        let (snap, results) = self
            .ctl
            .fork(&r.team_id, &r.sandbox_id, r.count, r.timeout_s)
            .await?;
        let results = results
            .into_iter()
            .map(|x| match x {
                Ok(row) => pb::ForkResult {
                    sandbox: Some(to_info(&self.ctl, &row)),
                    ..Default::default()
                },
                Err(e) => pb::ForkResult {
                    sandbox: None,
                    error_code: code_name(&e),
                    error: e.to_string(),
                },
            })
            .collect();
        Ok(Response::new(pb::ForkSandboxResponse {
            snapshot: Some(snapshot_info(&snap)),
            results,
        }))
    }
    async fn list_templates(
        &self,
        _req: Request<pb::ListTemplatesRequest>,
    ) -> Result<Response<pb::ListTemplatesResponse>, Status> {
        let templates = self.ctl.list_templates().await?;
        Ok(Response::new(pb::ListTemplatesResponse { templates }))
    }
    async fn get_template(
        &self,
        req: Request<pb::TemplateRef>,
    ) -> Result<Response<pb::TemplateInfo>, Status> {
        let name = req.into_inner().name;
        // Nodes may hold different builds: the newest one answers, with every holder listed.
        let builds = self.ctl.get_template(&name).await?;
        let mut newest = builds
            .iter()
            .max_by_key(|t| t.created_at_ms)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("template '{name}' not found")))?;
        let mut holders: Vec<String> = builds.into_iter().flat_map(|t| t.node_ids).collect();
        holders.sort();
        holders.dedup();
        newest.node_ids = holders;
        Ok(Response::new(newest))
    }
    async fn delete_template(
        &self,
        req: Request<pb::TemplateRef>,
    ) -> Result<Response<pb::DeleteTemplateResponse>, Status> {
        let builds_deleted = self.ctl.delete_template(&req.into_inner().name).await?;
        Ok(Response::new(pb::DeleteTemplateResponse { builds_deleted }))
    }
    type BuildTemplateStream = EventStream;
    async fn build_template(
        &self,
        req: Request<pb::BuildTemplateRequest>,
    ) -> Result<Response<Self::BuildTemplateStream>, Status> {
        let s = self.ctl.build_template(req.into_inner()).await?;
        Ok(Response::new(s))
    }
    async fn get_sandbox_metrics(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<cube_proto::nodev1::SandboxStatsResponse>, Status> {
        let r = req.into_inner();
        let s = self.ctl.sandbox_stats(&r.team_id, &r.sandbox_id).await?;
        Ok(Response::new(s))
    }

    async fn get_sandbox_metrics_history(
        &self,
        req: Request<pb::SandboxMetricsQuery>,
    ) -> Result<Response<cube_proto::nodev1::SandboxMetricsResponse>, Status> {
        let r = req.into_inner();
        let q = r
            .query
            .ok_or_else(|| Status::invalid_argument("query is required"))?;
        let s = self.ctl.sandbox_metrics_history(&r.team_id, q).await?;
        Ok(Response::new(s))
    }

    async fn get_sandbox_logs(
        &self,
        req: Request<pb::SandboxLogsQuery>,
    ) -> Result<Response<cube_proto::nodev1::SandboxLogsResponse>, Status> {
        let r = req.into_inner();
        let q = r
            .query
            .ok_or_else(|| Status::invalid_argument("query is required"))?;
        let s = self.ctl.sandbox_logs(&r.team_id, q).await?;
        Ok(Response::new(s))
    }

    async fn list_nodes(
        &self,
        _req: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        Ok(Response::new(pb::ListNodesResponse {
            nodes: node_infos(&self.ctl),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_names() {
        assert_eq!(
            code_name(&MasterError::ResourceExhausted("x".into())),
            "RESOURCE_EXHAUSTED"
        );
        assert_eq!(code_name(&MasterError::NotFound("x".into())), "NOT_FOUND");
        assert_eq!(code_name(&MasterError::Internal("x".into())), "INTERNAL");
    }
}
