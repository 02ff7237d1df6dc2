//! The template catalog: the union of the templates the ready nodes hold (asked live, so a
//! build that just finished is listed), builds fanned out to nodes with their progress
//! streams merged, and deletes forwarded to every node holding the template.

use super::Controller;
use crate::error::MasterError;
use crate::fleet::Node;
use cube_proto::master::v1 as pb;
use cube_proto::nodev1 as node;
use futures_util::{Stream, StreamExt};
use std::collections::{BTreeMap, HashSet};
use std::pin::Pin;
use std::time::Duration;

/// How long one node may take to list its templates.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);

pub type EventStream =
    Pin<Box<dyn Stream<Item = Result<pb::BuildTemplateEvent, tonic::Status>> + Send>>;

impl Controller {
    fn ready_nodes(&self) -> Vec<Node> {
        self.nodes
            .snapshot()
            .into_iter()
            .filter(|n| n.ready)
            .collect()
    }

    /// Every (template, build) the ready nodes hold as current, with the nodes holding it.
    /// Snapshots carry their snapshot id. Nodes that do not answer in time are left out.
    pub async fn list_templates(&self) -> Result<Vec<pb::TemplateInfo>, MasterError> {
        let nodes = self.ready_nodes();
        let answers = futures_util::future::join_all(nodes.iter().map(|n| {
            let mut c = n.client.clone();
            async move {
                let r = tokio::time::timeout(
                    LIST_TIMEOUT,
                    c.list_templates(node::ListTemplatesRequest {}),
                )
                .await;
                match r {
                    Ok(Ok(r)) => Some((n.id(), r.into_inner().templates)),
                    Ok(Err(e)) => {
                        tracing::warn!(node = %n.address, error = %e, "ListTemplates failed");
                        None
                    }
                    Err(_) => {
                        tracing::warn!(node = %n.address, "ListTemplates timed out");
                        None
                    }
                }
            }
        }))
        .await;
        let snapshot_ids: HashSet<String> = self
            .db
            .list_snapshot_rows()
            .await?
            .into_iter()
            .map(|s| s.id)
            .collect();
        let mut by_key: BTreeMap<(String, String), pb::TemplateInfo> = BTreeMap::new();
        for (node_id, templates) in answers.into_iter().flatten() {
            for t in templates {
                let e = by_key
                    .entry((t.name.clone(), t.build.clone()))
                    .or_insert_with(|| pb::TemplateInfo {
                        snapshot_id: if snapshot_ids.contains(&t.name) {
                            t.name.clone()
                        } else {
                            String::new()
                        },
                        name: t.name.clone(),
                        build: t.build.clone(),
                        source: t.source.clone(),
                        rootfs_bytes: t.rootfs_bytes,
                        created_at_ms: t.created_at_ms as i64,
                        node_ids: Vec::new(),
                    });
                e.node_ids.push(node_id.clone());
            }
        }
        Ok(by_key.into_values().collect())
    }

    /// The builds of one template (or snapshot id). Several when nodes hold different builds.
    pub async fn get_template(&self, name: &str) -> Result<Vec<pb::TemplateInfo>, MasterError> {
        let v: Vec<pb::TemplateInfo> = self
            .list_templates()
            .await?
            .into_iter()
            .filter(|t| t.name == name)
            .collect();
        if v.is_empty() {
            return Err(MasterError::NotFound(format!(
                "template '{name}' not found"
            )));
        }
        Ok(v)
    }

    /// Deletes every build of a template on every ready node that holds it. Snapshots go
    /// through [`Controller::delete_snapshot`] (their row and in-use check).
    pub async fn delete_template(&self, name: &str) -> Result<u32, MasterError> {
        if name.is_empty() {
            return Err(MasterError::InvalidArgument(
                "template name is required".into(),
            ));
        }
        if self.db.get_snapshot(name).await?.is_some() {
            let existed = self.delete_snapshot("", name).await?;
            return Ok(u32::from(existed));
        }
        let holders: Vec<Node> = self
            .ready_nodes()
            .into_iter()
            .filter(|n| {
                n.status
                    .as_ref()
                    .is_some_and(|s| s.templates.iter().any(|t| t == name))
            })
            .collect();
        let mut deleted = 0;
        let mut found = false;
        for n in holders {
            let mut c = n.client.clone();
            let r = tokio::time::timeout(
                Duration::from_secs(60),
                c.delete_template(node::DeleteTemplateRequest {
                    name: name.to_string(),
                    build: String::new(),
                }),
            )
            .await;
            match r {
                Ok(Ok(r)) => {
                    found = true;
                    deleted += r.into_inner().builds_deleted;
                }
                Ok(Err(s)) if s.code() == tonic::Code::NotFound => {}
                Ok(Err(s)) => {
                    return Err(MasterError::Node {
                        node: n.address,
                        status: Box::new(s),
                    })
                }
                Err(_) => {
                    return Err(MasterError::Unavailable(format!(
                        "deleting template {name} timed out on node {}",
                        n.address
                    )))
                }
            }
        }
        if !found {
            return Err(MasterError::NotFound(format!(
                "template '{name}' not found"
            )));
        }
        tracing::info!(template = %name, builds = deleted, "template deleted");
        Ok(deleted)
    }

    /// Starts the build on the chosen nodes and merges their event streams, each event tagged
    /// with its node. A node that fails (or whose stream breaks) yields one `error` event; the
    /// other nodes go on. Every node's stream ends with exactly one `done` or `error` event.
    pub async fn build_template(
        &self,
        req: pb::BuildTemplateRequest,
    ) -> Result<EventStream, MasterError> {
        let Some(recipe) = req.recipe else {
            return Err(MasterError::InvalidArgument(
                "BuildTemplate: recipe is required".into(),
            ));
        };
        if recipe.name.is_empty() {
            return Err(MasterError::InvalidArgument(
                "BuildTemplate: recipe.name is required".into(),
            ));
        }
        if recipe.source.is_none() {
            return Err(MasterError::InvalidArgument(
                "BuildTemplate: a source (debootstrap, oci_path or directory) is required".into(),
            ));
        }
        let targets: Vec<Node> = if req.node_id.is_empty() {
            let v = self.ready_nodes();
            if v.is_empty() {
                return Err(MasterError::Unavailable("no node is ready".into()));
            }
            v
        } else {
            let n = self
                .nodes
                .find(&req.node_id)
                .ok_or_else(|| MasterError::NotFound(format!("node {} not found", req.node_id)))?;
            if !n.ready {
                return Err(MasterError::Unavailable(format!(
                    "node {} is not ready",
                    req.node_id
                )));
            }
            vec![n]
        };
        let mut streams: Vec<EventStream> = Vec::new();
        for n in targets {
            let id = n.id();
            let mut c = n.client.clone();
            let recipe = recipe.clone();
            let s = async_stream_of(id, async move { c.build_template(recipe).await });
            streams.push(s);
        }
        Ok(Box::pin(futures_util::stream::select_all(streams)))
    }
}

fn event(node_id: &str, e: node::TemplateBuildEvent) -> pb::BuildTemplateEvent {
    let template = e.template.map(|t| pb::TemplateInfo {
        name: t.name,
        build: t.build,
        source: t.source,
        rootfs_bytes: t.rootfs_bytes,
        created_at_ms: t.created_at_ms as i64,
        node_ids: vec![node_id.to_string()],
        snapshot_id: String::new(),
    });
    pb::BuildTemplateEvent {
        node_id: node_id.to_string(),
        kind: e.kind,
        message: e.message,
        done: e.done,
        total: e.total,
        template,
    }
}

fn error_event(node_id: &str, message: String) -> pb::BuildTemplateEvent {
    pb::BuildTemplateEvent {
        node_id: node_id.to_string(),
        kind: "error".into(),
        message,
        ..Default::default()
    }
}

/// One node's events: the call's own error, a broken stream or a stream that ends without a
/// verdict each become an `error` event, so the caller always learns the node's outcome.
fn async_stream_of<F>(node_id: String, call: F) -> EventStream
where
    F: std::future::Future<
            Output = Result<
                tonic::Response<tonic::Streaming<node::TemplateBuildEvent>>,
                tonic::Status,
            >,
        > + Send
        + 'static,
{
    enum St<F> {
        Start(F),
        Streaming(Box<tonic::Streaming<node::TemplateBuildEvent>>),
        Done,
    }
    let s = futures_util::stream::unfold(
        (St::Start(Box::pin(call)), node_id),
        |(st, node_id)| async move {
            let mut inner = match st {
                St::Done => return None,
                St::Start(f) => match f.await {
                    Ok(r) => r.into_inner(),
                    Err(e) => {
                        let ev = error_event(&node_id, format!("BuildTemplate: {}", e.message()));
                        return Some((Ok(ev), (St::Done, node_id)));
                    }
                },
                St::Streaming(s) => *s,
            };
            match inner.next().await {
                Some(Ok(e)) => {
                    let last = e.kind == "done" || e.kind == "error";
                    let ev = event(&node_id, e);
                    let next = if last {
                        St::Done
                    } else {
                        St::Streaming(Box::new(inner))
                    };
                    Some((Ok(ev), (next, node_id)))
                }
                Some(Err(e)) => {
                    let ev = error_event(&node_id, format!("build stream broke: {}", e.message()));
                    Some((Ok(ev), (St::Done, node_id)))
                }
                None => {
                    let ev = error_event(&node_id, "build stream ended without a result".into());
                    Some((Ok(ev), (St::Done, node_id)))
                }
            }
        },
    );
    Box::pin(s)
}
