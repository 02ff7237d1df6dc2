//! The `cube.node.v1.Node` gRPC service.

use crate::network::Policy;
use crate::node::{CreateRequest, Node, NodeError, Phase, SandboxState, Shape};
use crate::template::{Manifest, Source};
use cube_proto::nodev1 as pb;
use std::path::Path;
use std::sync::Arc;
use tonic::{Request, Response, Status};

impl From<NodeError> for Status {
    fn from(e: NodeError) -> Status {
        match e {
            NodeError::InvalidArgument(m) => Status::invalid_argument(m),
            NodeError::NotFound(m) => Status::not_found(m),
            NodeError::AlreadyExists(m) => Status::already_exists(m),
            NodeError::FailedPrecondition(m) => Status::failed_precondition(m),
            NodeError::ResourceExhausted(m) => Status::resource_exhausted(m),
            NodeError::DeadlineExceeded(m) => Status::deadline_exceeded(m),
            NodeError::Internal(m) => Status::internal(m),
        }
    }
}

/// The service implementation.
pub struct NodeService {
    pub node: Arc<Node>,
}

// tonic's Status is the service's error type; boxing it here would only move the cost.
#[allow(clippy::result_large_err)]
fn policy_from(p: Option<pb::NetworkPolicy>) -> Result<Policy, Status> {
    let Some(p) = p else {
        return Ok(Policy {
            internet: true,
            ..Default::default()
        });
    };
    check_egress(&p.allow_cidrs, &p.deny_cidrs)?;
    for a in &p.host_services {
        if a.parse::<std::net::Ipv4Addr>().is_err() {
            return Err(Status::invalid_argument(format!(
                "network policy: host service {a:?} is not an IPv4 address"
            )));
        }
    }
    let mut ports = Vec::new();
    for e in p.exposed_ports {
        let port = u16::try_from(e.port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                Status::invalid_argument(format!("network policy: port {} is out of range", e.port))
            })?;
        ports.push(port);
    }
    Ok(Policy {
        internet: p.internet,
        allow_cidrs: p.allow_cidrs,
        deny_cidrs: p.deny_cidrs,
        exposed_ports: ports,
        all_ports: p.all_ports,
        host_services: p.host_services,
        allow_names: check_names(p.allow_names)?,
        dns: p.dns,
    })
}

/// Allowed names, checked and normalised (the proxy compares them in that form).
#[allow(clippy::result_large_err)]
fn check_names(v: Vec<String>) -> Result<Vec<String>, Status> {
    crate::egress_proxy::NameSet::parse(&v)
        .map_err(|e| Status::invalid_argument(format!("network policy: {e}")))?;
    Ok(v)
}

/// Allow and deny entries are CIDRs; an allow entry must not lie inside a range the switch
/// denies by default (private, shared, link-local, loopback, reserved): it would override that
/// deny, and these lists come from users.
#[allow(clippy::result_large_err)]
fn check_egress(allow: &[String], deny: &[String]) -> Result<(), Status> {
    for c in allow.iter().chain(deny.iter()) {
        let ok = c.split_once('/').is_some_and(|(ip, len)| {
            ip.parse::<std::net::IpAddr>().is_ok() && len.parse::<u8>().is_ok_and(|l| l <= 128)
        });
        if !ok {
            return Err(Status::invalid_argument(format!(
                "network policy: {c:?} is not a CIDR (a.b.c.d/len)"
            )));
        }
    }
    for c in allow {
        let Ok(cidr) = c.parse::<cube_vs::Ipv4Cidr>() else {
            continue; // IPv6: sandboxes have none, so it can open nothing
        };
        if let Some(r) = cube_vs::reserved_range_of(&cidr) {
            return Err(Status::invalid_argument(format!(
                "network policy: allow entry {c} is inside {r}, which sandboxes may not reach"
            )));
        }
    }
    Ok(())
}

fn policy_to(p: &Policy) -> pb::NetworkPolicy {
    pb::NetworkPolicy {
        internet: p.internet,
        allow_cidrs: p.allow_cidrs.clone(),
        deny_cidrs: p.deny_cidrs.clone(),
        exposed_ports: p
            .exposed_ports
            .iter()
            .map(|x| pb::ExposedPort {
                port: u32::from(*x),
            })
            .collect(),
        all_ports: p.all_ports,
        host_services: p.host_services.clone(),
        allow_names: p.allow_names.clone(),
        dns: p.dns,
    }
}

fn sandbox_to(node: &Node, s: &SandboxState) -> pb::Sandbox {
    let state = match s.phase {
        Phase::Creating | Phase::Pooled => pb::SandboxState::Creating,
        Phase::Running => pb::SandboxState::Running,
        Phase::Paused => pb::SandboxState::Paused,
        Phase::Failed => pb::SandboxState::Failed,
    };
    pb::Sandbox {
        sandbox_id: s.id.clone(),
        template: s.template.clone(),
        build: s.build.clone(),
        state: state as i32,
        runtime: s.runtime.name().into(),
        shape: Some(pb::Shape {
            vcpus: s.shape.vcpus,
            memory_mib: s.shape.memory_mib,
            disk_mib: s.shape.disk_mib,
        }),
        metadata: s.metadata.clone().into_iter().collect(),
        agent_address: node.agent_address(s),
        host_interface: s
            .endpoint
            .as_ref()
            .map(|e| e.host_if.clone())
            .or_else(|| s.runtime.microvm().and_then(|m| m.tap.clone()))
            .unwrap_or_default(),
        created_at_ms: s.created_at_ms,
        create_latency_us: s.create_latency_us,
        from_pool: s.from_pool,
        network: Some(policy_to(&s.policy)),
        end_at_ms: s.end_at_ms,
        envd_version: s.envd_version.clone(),
    }
}

fn template_to(m: &Manifest, reused: bool) -> pb::Template {
    pb::Template {
        name: m.name.clone(),
        build: m.build.clone(),
        source: m.source.clone(),
        rootfs_bytes: m.rootfs.bytes,
        rootfs_sha256: m.rootfs.sha256.clone(),
        created_at_ms: m.created_at_ms,
        env: m.image.env.clone(),
        cmd: m
            .image
            .entrypoint
            .iter()
            .chain(m.image.cmd.iter())
            .cloned()
            .collect(),
        workdir: m.image.workdir.clone(),
        user: m.image.user.clone(),
        reused,
    }
}

fn mem_total_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(0)
}

fn disk_free_mib(p: &std::path::Path) -> u64 {
    let c = crate::storage::cstr(p);
    // SAFETY: statvfs into a zeroed struct.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return 0;
    }
    (s.f_bavail as u64 * s.f_frsize as u64) >> 20
}

/// The build source of an ImportTemplate/BuildTemplate request, checked.
// tonic's Status is the service's error type; boxing it here would only move the cost.
#[allow(clippy::result_large_err)]
fn source_from(r: &pb::ImportTemplateRequest, staging: &Path) -> Result<Source, Status> {
    let source = match r.source.clone() {
        Some(pb::import_template_request::Source::Debootstrap(d)) => {
            let base = Source::base();
            let Source::Debootstrap {
                suite,
                packages,
                mirror,
            } = base
            else {
                return Err(Status::internal("base recipe"));
            };
            Source::Debootstrap {
                suite: if d.suite.is_empty() { suite } else { d.suite },
                packages: if d.packages.is_empty() {
                    packages
                } else {
                    d.packages
                },
                mirror: if d.mirror.is_empty() {
                    mirror
                } else {
                    d.mirror
                },
            }
        }
        Some(pb::import_template_request::Source::OciPath(p)) => Source::Oci { path: p.into() },
        Some(pb::import_template_request::Source::Directory(p)) => {
            Source::Directory { path: p.into() }
        }
        None => {
            return Err(Status::invalid_argument(
                "ImportTemplate: a source (debootstrap, oci_path or directory) is required",
            ))
        }
    };
    source
        .confined(staging)
        .map_err(|e| Status::invalid_argument(format!("ImportTemplate: {e}")))
}

/// A build's progress event on the wire.
fn build_event(e: crate::template::BuildEvent) -> pb::TemplateBuildEvent {
    use crate::template::BuildEvent as B;
    let (kind, message, bytes) = match e {
        B::Phase(p) => ("phase", p.to_string(), 0),
        B::Log(l) => ("progress", l, 0),
        B::Reused => ("phase", "reusing the existing build".to_string(), 0),
        B::Done { bytes } => (
            "progress",
            "root filesystem image written".to_string(),
            bytes,
        ),
    };
    pb::TemplateBuildEvent {
        kind: kind.into(),
        message,
        done: bytes,
        total: bytes,
        template: None,
    }
}

#[tonic::async_trait]
impl pb::node_server::Node for NodeService {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let r = req.into_inner();
        let shape = r.shape.unwrap_or_default();
        let policy = policy_from(r.network)?;
        if policy.has_egress_rules() && !self.node.host.net.hook().isolates() {
            return Err(Status::failed_precondition(
                "network policy: this node has no switch (network.switch = \"none\"), so \
                 allow and deny entries cannot be enforced",
            ));
        }
        let cr = CreateRequest {
            id: r.sandbox_id,
            template: r.template,
            build: r.build,
            shape: Shape {
                vcpus: shape.vcpus,
                memory_mib: shape.memory_mib,
                disk_mib: shape.disk_mib,
            },
            env_vars: r.env_vars.into_iter().collect(),
            metadata: r.metadata.into_iter().collect(),
            policy,
            access_token: r.access_token,
            default_user: r.default_user,
            default_workdir: r.default_workdir,
            ready_timeout_ms: r.ready_timeout_ms,
            from_snapshot: r.from_snapshot,
            end_at_ms: r.end_at_ms,
            timeout_ms: r.timeout_ms,
        };
        let st = self.node.create(cr).await?;
        Ok(Response::new(sandbox_to(&self.node, &st)))
    }

    async fn set_end_time(
        &self,
        req: Request<pb::SetEndTimeRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let r = req.into_inner();
        let st = self.node.set_end_time(&r.sandbox_id, r.end_at_ms).await?;
        Ok(Response::new(sandbox_to(&self.node, &st)))
    }

    async fn set_egress(
        &self,
        req: Request<pb::SetEgressRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let r = req.into_inner();
        check_egress(&r.allow_cidrs, &r.deny_cidrs)?;
        let egress = crate::network::Egress {
            internet: r.internet,
            allow_cidrs: r.allow_cidrs,
            deny_cidrs: r.deny_cidrs,
            allow_names: check_names(r.allow_names)?,
            dns: r.dns,
        };
        let st = self.node.set_egress(&r.sandbox_id, egress).await?;
        Ok(Response::new(sandbox_to(&self.node, &st)))
    }

    async fn kill_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::KillSandboxResponse>, Status> {
        let existed = self.node.kill(&req.into_inner().sandbox_id).await?;
        Ok(Response::new(pb::KillSandboxResponse { existed }))
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::PauseSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let r = req.into_inner();
        let st = self.node.pause(&r.sandbox_id, !r.filesystem_only).await?;
        Ok(Response::new(sandbox_to(&self.node, &st)))
    }

    async fn resume_sandbox(
        &self,
        req: Request<pb::ResumeSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let r = req.into_inner();
        let st = self.node.resume(&r.sandbox_id, r.reboot).await?;
        Ok(Response::new(sandbox_to(&self.node, &st)))
    }

    async fn snapshot_sandbox(
        &self,
        req: Request<pb::SnapshotSandboxRequest>,
    ) -> Result<Response<pb::SnapshotSandboxResponse>, Status> {
        let r = req.into_inner();
        let (m, reused) = self.node.snapshot(&r.sandbox_id, &r.template).await?;
        Ok(Response::new(pb::SnapshotSandboxResponse {
            template: Some(template_to(&m, reused)),
            filesystem_only: self.node.snapshot_kind() == crate::runtime::SnapshotKind::Filesystem,
        }))
    }

    async fn list_sandboxes(
        &self,
        _req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let v = self.node.list().await;
        Ok(Response::new(pb::ListSandboxesResponse {
            sandboxes: v.iter().map(|s| sandbox_to(&self.node, s)).collect(),
        }))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let st = self.node.get(&req.into_inner().sandbox_id).await?;
        Ok(Response::new(sandbox_to(&self.node, &st)))
    }

    async fn list_templates(
        &self,
        _req: Request<pb::ListTemplatesRequest>,
    ) -> Result<Response<pb::ListTemplatesResponse>, Status> {
        let v = self.node.host.templates.list();
        Ok(Response::new(pb::ListTemplatesResponse {
            templates: v
                .iter()
                .filter(|(_, cur)| *cur)
                .map(|(m, _)| template_to(m, false))
                .collect(),
        }))
    }

    async fn import_template(
        &self,
        req: Request<pb::ImportTemplateRequest>,
    ) -> Result<Response<pb::Template>, Status> {
        let r = req.into_inner();
        let source = source_from(&r, &self.node.host.cfg.staging_dir())?;
        let name = r.name.clone();
        let progress = Arc::new(
            move |e: crate::template::BuildEvent| tracing::info!(template = %name, event = ?e, "template build"),
        );
        let (m, reused) = self
            .node
            .import_template(&r.name, source, r.extra_mib, progress)
            .await?;
        Ok(Response::new(template_to(&m, reused)))
    }

    async fn delete_template(
        &self,
        req: Request<pb::DeleteTemplateRequest>,
    ) -> Result<Response<pb::DeleteTemplateResponse>, Status> {
        let r = req.into_inner();
        let n = self
            .node
            .delete_template(&r.name, Some(r.build.as_str()).filter(|b| !b.is_empty()))
            .await?;
        Ok(Response::new(pb::DeleteTemplateResponse {
            builds_deleted: n,
        }))
    }

    type BuildTemplateStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<pb::TemplateBuildEvent, Status>> + Send>,
    >;
    /// ImportTemplate with its progress streamed. The build runs to the end even when the
    /// caller goes away (the result is a usable template either way).
    async fn build_template(
        &self,
        req: Request<pb::ImportTemplateRequest>,
    ) -> Result<Response<Self::BuildTemplateStream>, Status> {
        let r = req.into_inner();
        crate::template::check_name(&r.name).map_err(NodeError::from)?;
        let source = source_from(&r, &self.node.host.cfg.staging_dir())?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let ptx = tx.clone();
        let name = r.name.clone();
        let progress = Arc::new(move |e: crate::template::BuildEvent| {
            tracing::info!(template = %name, event = ?e, "template build");
            let _ = ptx.send(build_event(e));
        });
        let node = self.node.clone();
        tokio::spawn(async move {
            let last = match node
                .import_template(&r.name, source, r.extra_mib, progress)
                .await
            {
                Ok((m, reused)) => pb::TemplateBuildEvent {
                    kind: "done".into(),
                    message: if reused {
                        format!("template {} build {} reused", m.name, m.build)
                    } else {
                        format!("template {} build {} ready", m.name, m.build)
                    },
                    done: m.rootfs.bytes,
                    total: m.rootfs.bytes,
                    template: Some(template_to(&m, reused)),
                },
                Err(e) => pb::TemplateBuildEvent {
                    kind: "error".into(),
                    message: e.to_string(),
                    ..Default::default()
                },
            };
            let _ = tx.send(last);
        });
        let s = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|e| (Ok::<_, Status>(e), rx))
        });
        Ok(Response::new(Box::pin(s)))
    }

    async fn sandbox_stats(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatsResponse>, Status> {
        let r = self.node.sample(&req.into_inner().sandbox_id).await?;
        Ok(Response::new(r))
    }

    async fn sandbox_metrics(
        &self,
        req: Request<pb::SandboxMetricsRequest>,
    ) -> Result<Response<pb::SandboxMetricsResponse>, Status> {
        let r = req.into_inner();
        let samples = self
            .node
            .metrics_history(&r.sandbox_id, r.start_ms, r.end_ms)
            .await?;
        Ok(Response::new(pb::SandboxMetricsResponse { samples }))
    }

    async fn sandbox_logs(
        &self,
        req: Request<pb::SandboxLogsRequest>,
    ) -> Result<Response<pb::SandboxLogsResponse>, Status> {
        let entries = self.node.logs(&req.into_inner()).await?;
        Ok(Response::new(pb::SandboxLogsResponse { entries }))
    }

    async fn guest_health(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::GuestHealthResponse>, Status> {
        let (healthy, detail) = self.node.guest_health(&req.into_inner().sandbox_id).await?;
        Ok(Response::new(pb::GuestHealthResponse { healthy, detail }))
    }

    async fn node_status(
        &self,
        _req: Request<pb::NodeStatusRequest>,
    ) -> Result<Response<pb::NodeStatusResponse>, Status> {
        let n = &self.node;
        let list = n.list_settled();
        let alloc = pb::Capacity {
            vcpus: list.iter().map(|s| s.shape.vcpus).sum(),
            memory_mib: list.iter().map(|s| s.shape.memory_mib).sum(),
            disk_free_mib: 0,
            max_sandboxes: 0,
        };
        let cap = pb::Capacity {
            vcpus: std::thread::available_parallelism()
                .map(|x| x.get() as u32)
                .unwrap_or(1),
            memory_mib: mem_total_mib(),
            disk_free_mib: disk_free_mib(&n.host.cfg.data_dir),
            max_sandboxes: n.host.cfg.sandbox.max_sandboxes,
        };
        let mut templates: Vec<String> = n
            .host
            .templates
            .list()
            .into_iter()
            .filter(|(_, c)| *c)
            .map(|(m, _)| m.name)
            .collect();
        templates.dedup();
        Ok(Response::new(pb::NodeStatusResponse {
            node_id: n.host.cfg.node_id(),
            version: env!("CARGO_PKG_VERSION").into(),
            runtime: n.selection.runtime.into(),
            kvm_kind: n.selection.kvm_kind.clone(),
            capacity: Some(cap),
            allocated: Some(alloc),
            // Every sandbox, creating ones too (the master's in-flight count relies on it);
            // only the allocation sums skip the ones mid-operation.
            sandboxes: n.count() as u32,
            templates,
            pools: n
                .pool_levels()
                .into_iter()
                .map(|l| pb::PoolLevel {
                    pool: l.pool,
                    template: l.template,
                    ready: l.ready,
                    target: l.target,
                })
                .collect(),
            storage_mode: n.host.storage_mode.as_str().into(),
            cgroup_mode: n.host.cg.mode_name().into(),
        }))
    }
}
