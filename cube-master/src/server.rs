//! The `cube.master.v1.Master` gRPC service over a [`Controller`].

use crate::apikey;
use crate::db::SandboxRow;
use crate::service::{Controller, CreateParams, ListParams};
use crate::state::SandboxState;
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

pub fn to_info(r: &SandboxRow) -> pb::SandboxInfo {
    pb::SandboxInfo {
        sandbox_id: r.id.clone(),
        team_id: r.team_id.clone(),
        template: r.template.clone(),
        build: r.build.clone(),
        state: r.state.clone(),
        reason: r.reason.clone(),
        node_id: r.node_id.clone(),
        agent_address: r.agent_address.clone(),
        host_interface: r.host_interface.clone(),
        access_token: r.access_token.clone(),
        envd_version: r.envd_version.clone(),
        metadata: r.metadata_map().into_iter().collect(),
        started_at_ms: r.started_at_ms,
        end_at_ms: r.end_at_ms,
        vcpus: r.vcpus.max(0) as u32,
        memory_mib: r.memory_mib.max(0) as u64,
        disk_mib: r.disk_mib.max(0) as u64,
        runtime: r.runtime.clone(),
    }
}

fn key_info(k: &crate::db::ApiKeyRow) -> pb::ApiKey {
    pb::ApiKey {
        id: k.id.clone(),
        name: k.name.clone(),
        team_id: k.team_id.clone(),
        prefix: k.prefix.clone(),
        created_at_ms: k.created_at_ms,
        revoked: k.revoked != 0,
    }
}

#[tonic::async_trait]
impl Master for MasterService {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let r = req.into_inner();
        let row = self
            .ctl
            .create(CreateParams {
                team_id: r.team_id,
                template: r.template,
                timeout_s: r.timeout_s,
                metadata: r.metadata.into_iter().collect(),
                env_vars: r.env_vars.into_iter().collect(),
                allow_internet: r.allow_internet,
            })
            .await?;
        Ok(Response::new(to_info(&row)))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let r = req.into_inner();
        let row = self.ctl.get(&r.team_id, &r.sandbox_id).await?;
        Ok(Response::new(to_info(&row)))
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
            })
            .await?;
        Ok(Response::new(pb::ListSandboxesResponse {
            sandboxes: rows.iter().map(to_info).collect(),
            next_token: next,
        }))
    }

    async fn kill_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::KillSandboxResponse>, Status> {
        let r = req.into_inner();
        let existed = self
            .ctl
            .kill(&r.team_id, &r.sandbox_id, "killed by request")
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
            .set_timeout(&r.team_id, &r.sandbox_id, r.timeout_s)
            .await?;
        Ok(Response::new(to_info(&row)))
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let r = req.into_inner();
        let row = self.ctl.pause(&r.team_id, &r.sandbox_id).await?;
        Ok(Response::new(to_info(&row)))
    }

    async fn connect_sandbox(
        &self,
        req: Request<pb::ConnectSandboxRequest>,
    ) -> Result<Response<pb::ConnectSandboxResponse>, Status> {
        let r = req.into_inner();
        let (row, resumed) = self
            .ctl
            .connect(&r.team_id, &r.sandbox_id, r.timeout_s)
            .await?;
        Ok(Response::new(pb::ConnectSandboxResponse {
            sandbox: Some(to_info(&row)),
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
        Ok(Response::new(to_info(&row)))
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

    // PLACEHOLDER(lead): replaced by the real implementations during this session.
    async fn register_node(
        &self,
        _req: Request<pb::RegisterNodeRequest>,
    ) -> Result<Response<pb::RegisterNodeResponse>, Status> {
        Err(Status::unimplemented("register_node"))
    }
    async fn node_heartbeat(
        &self,
        _req: Request<pb::NodeHeartbeatRequest>,
    ) -> Result<Response<pb::NodeHeartbeatResponse>, Status> {
        Err(Status::unimplemented("node_heartbeat"))
    }
    async fn cordon_node(
        &self,
        _req: Request<pb::NodeRef>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        Err(Status::unimplemented("cordon_node"))
    }
    async fn uncordon_node(
        &self,
        _req: Request<pb::NodeRef>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        Err(Status::unimplemented("uncordon_node"))
    }
    async fn drain_node(
        &self,
        _req: Request<pb::DrainNodeRequest>,
    ) -> Result<Response<pb::DrainNodeResponse>, Status> {
        Err(Status::unimplemented("drain_node"))
    }
    async fn create_join_token(
        &self,
        _req: Request<pb::CreateJoinTokenRequest>,
    ) -> Result<Response<pb::CreateJoinTokenResponse>, Status> {
        Err(Status::unimplemented("create_join_token"))
    }
    async fn snapshot_sandbox(
        &self,
        _req: Request<pb::SnapshotSandboxRequest>,
    ) -> Result<Response<pb::SnapshotInfo>, Status> {
        Err(Status::unimplemented("snapshot_sandbox"))
    }
    async fn list_snapshots(
        &self,
        _req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        Err(Status::unimplemented("list_snapshots"))
    }
    async fn delete_snapshot(
        &self,
        _req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        Err(Status::unimplemented("delete_snapshot"))
    }
    async fn fork_sandbox(
        &self,
        _req: Request<pb::ForkSandboxRequest>,
    ) -> Result<Response<pb::ForkSandboxResponse>, Status> {
        Err(Status::unimplemented("fork_sandbox"))
    }
    async fn list_templates(
        &self,
        _req: Request<pb::ListTemplatesRequest>,
    ) -> Result<Response<pb::ListTemplatesResponse>, Status> {
        Err(Status::unimplemented("list_templates"))
    }
    async fn get_template(
        &self,
        _req: Request<pb::TemplateRef>,
    ) -> Result<Response<pb::TemplateInfo>, Status> {
        Err(Status::unimplemented("get_template"))
    }
    async fn delete_template(
        &self,
        _req: Request<pb::TemplateRef>,
    ) -> Result<Response<pb::DeleteTemplateResponse>, Status> {
        Err(Status::unimplemented("delete_template"))
    }
    type BuildTemplateStream = std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<pb::BuildTemplateEvent, Status>> + Send>,
    >;
    async fn build_template(
        &self,
        _req: Request<pb::BuildTemplateRequest>,
    ) -> Result<Response<Self::BuildTemplateStream>, Status> {
        Err(Status::unimplemented("build_template"))
    }

    async fn list_nodes(
        &self,
        _req: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let nodes = self
            .ctl
            .nodes
            .snapshot()
            .into_iter()
            .map(|n| {
                let s = n.status.clone().unwrap_or_default();
                pb::NodeInfo {
                    node_id: n.id(),
                    address: n.address.clone(),
                    status: if n.ready { "ready" } else { "not_ready" }.into(),
                    runtime: s.runtime,
                    sandboxes: s.sandboxes,
                    templates: s.templates,
                    max_sandboxes: s.capacity.map(|c| c.max_sandboxes).unwrap_or(0),
                    ..Default::default()
                }
            })
            .collect();
        Ok(Response::new(pb::ListNodesResponse { nodes }))
    }
}
