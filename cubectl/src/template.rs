//! `cubectl template build|list|inspect|rm`.

use crate::client::{self, Master, StatusExt};
use crate::output::{self, Table};
use crate::progress::{BuildProgress, Event};
use clap::{Args, Subcommand};
use cube_proto::master::v1 as pb;
use cube_proto::node::v1 as npb;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum TemplateCmd {
    /// Builds a template on every ready node (or one, with --node), with progress.
    Build(BuildArgs),
    /// Lists the templates held by ready nodes (snapshots included).
    List,
    /// Shows one template (by name or snapshot id).
    Inspect { name: String },
    /// Deletes a template (every build, on every node).
    Rm { name: String },
}

#[derive(Args, Debug, Clone)]
pub struct BuildArgs {
    /// Template name: lower-case letters, digits, `-`, `_`, `.`.
    pub name: String,
    /// Debian suite to debootstrap (e.g. bookworm). `base` needs no source: it has a default recipe.
    #[arg(long, conflicts_with_all = ["oci", "dir"], value_name = "SUITE")]
    pub debootstrap: Option<String>,
    /// Extra Debian packages (with --debootstrap), comma separated.
    #[arg(long, value_delimiter = ',', requires = "debootstrap")]
    pub packages: Vec<String>,
    /// Debian mirror (with --debootstrap).
    #[arg(long, requires = "debootstrap")]
    pub mirror: Option<String>,
    /// An OCI image layout directory or `docker save` tarball (a path on the node).
    #[arg(long, conflicts_with = "dir", value_name = "PATH")]
    pub oci: Option<PathBuf>,
    /// A root filesystem directory (a path on the node).
    #[arg(long, value_name = "PATH")]
    pub dir: Option<PathBuf>,
    /// Extra free space in the image, MiB.
    #[arg(long, default_value_t = 0)]
    pub extra_mib: u64,
    /// Build on this node only.
    #[arg(long, default_value = "")]
    pub node: String,
}

/// A path for the node: absolute; checked here when it exists on this host.
fn node_path(p: &Path) -> anyhow::Result<String> {
    match std::fs::canonicalize(p) {
        Ok(abs) => Ok(abs.display().to_string()),
        Err(_) if p.is_absolute() => Ok(p.display().to_string()),
        Err(e) => anyhow::bail!("{}: {e}", p.display()),
    }
}

/// The node-level recipe for a build.
pub fn recipe(a: &BuildArgs) -> anyhow::Result<npb::ImportTemplateRequest> {
    use npb::import_template_request::Source;
    let source = match (&a.debootstrap, &a.oci, &a.dir) {
        (Some(suite), _, _) => Source::Debootstrap(npb::DebootstrapSource {
            suite: suite.clone(),
            packages: a.packages.clone(),
            mirror: a.mirror.clone().unwrap_or_default(),
        }),
        (_, Some(p), _) => Source::OciPath(node_path(p)?),
        (_, _, Some(p)) => Source::Directory(node_path(p)?),
        // Empty suite and packages: the node's default `base` recipe.
        _ if a.name == "base" => Source::Debootstrap(npb::DebootstrapSource::default()),
        _ => anyhow::bail!(
            "give a source for template {:?}: --debootstrap SUITE, --oci PATH or --dir PATH (only `base` has a default recipe)",
            a.name
        ),
    };
    Ok(npb::ImportTemplateRequest {
        name: a.name.clone(),
        source: Some(source),
        extra_mib: a.extra_mib,
    })
}

pub fn template_json(t: &pb::TemplateInfo) -> serde_json::Value {
    json!({
        "name": t.name, "build": t.build, "source": t.source, "rootfsBytes": t.rootfs_bytes,
        "createdAtMs": t.created_at_ms, "nodes": t.node_ids, "snapshotId": t.snapshot_id,
    })
}

/// Builds through the master's stream; returns the template as each node reported it.
pub async fn build_via_master(
    m: &mut Master,
    recipe: npb::ImportTemplateRequest,
    node: &str,
) -> Result<Vec<pb::TemplateInfo>, tonic::Status> {
    let name = recipe.name.clone();
    let mut stream = m
        .build_template(pb::BuildTemplateRequest {
            recipe: Some(recipe),
            node_id: node.to_string(),
        })
        .await?
        .into_inner();
    let mut bar = BuildProgress::new(&format!("template {name}"));
    let mut built = Vec::new();
    let mut errors = Vec::new();
    while let Some(ev) = stream.message().await? {
        bar.event(&Event {
            node: ev.node_id.clone(),
            kind: ev.kind.clone(),
            message: ev.message.clone(),
            done: ev.done,
            total: ev.total,
        });
        match ev.kind.as_str() {
            "done" => built.push(ev.template.unwrap_or_default()),
            "error" => errors.push(if ev.node_id.is_empty() {
                ev.message
            } else {
                format!("{}: {}", ev.node_id, ev.message)
            }),
            _ => {}
        }
    }
    bar.finish();
    if !errors.is_empty() {
        return Err(tonic::Status::internal(errors.join("; ")));
    }
    if built.is_empty() {
        return Err(tonic::Status::internal(
            "the build stream ended without a result (no ready node?)",
        ));
    }
    Ok(built)
}

pub async fn run(cmd: TemplateCmd, m: &mut Master, as_json: bool) -> anyhow::Result<()> {
    match cmd {
        TemplateCmd::Build(a) => {
            let r = recipe(&a)?;
            let name = a.name.clone();
            let built = build_via_master(m, r, &a.node)
                .await
                .map_err(|s| client::status(&format!("building template {name}"), s))?;
            if as_json {
                output::json(&built.iter().map(template_json).collect());
            } else {
                for t in &built {
                    println!(
                        "{} build {} ({}, {})",
                        t.name,
                        t.build,
                        t.source,
                        output::bytes(t.rootfs_bytes)
                    );
                }
            }
        }
        TemplateCmd::List => {
            let r = m
                .list_templates(pb::ListTemplatesRequest {})
                .await
                .ctx("listing templates")?;
            if as_json {
                output::json(&r.templates.iter().map(template_json).collect());
            } else {
                let mut t = Table::new(&["NAME", "BUILD", "SOURCE", "SIZE", "CREATED", "NODES"]);
                for x in &r.templates {
                    t.row(vec![
                        x.name.clone(),
                        x.build.clone(),
                        x.source.clone(),
                        output::bytes(x.rootfs_bytes),
                        output::time_ms(x.created_at_ms),
                        output::list(&x.node_ids),
                    ]);
                }
                t.print();
            }
        }
        TemplateCmd::Inspect { name } => {
            let x = m
                .get_template(pb::TemplateRef { name: name.clone() })
                .await
                .ctx(format!("template {name}"))?;
            if as_json {
                output::json(&template_json(&x));
            } else {
                let mut t = Table::new(&["FIELD", "VALUE"]);
                for (k, v) in [
                    ("name", x.name.clone()),
                    ("build", x.build.clone()),
                    ("source", x.source.clone()),
                    ("size", output::bytes(x.rootfs_bytes)),
                    ("created", output::time_ms(x.created_at_ms)),
                    ("nodes", output::list(&x.node_ids)),
                    ("snapshot", x.snapshot_id.clone()),
                ] {
                    if !v.is_empty() {
                        t.row(vec![k.into(), v]);
                    }
                }
                t.print();
            }
        }
        TemplateCmd::Rm { name } => {
            let r = m
                .delete_template(pb::TemplateRef { name: name.clone() })
                .await
                .ctx(format!("deleting template {name}"))?;
            if r.builds_deleted == 0 {
                anyhow::bail!("no template {name}");
            }
            if as_json {
                output::json(&json!({"name": name, "buildsDeleted": r.builds_deleted}));
            } else {
                println!("deleted {name} ({} build(s))", r.builds_deleted);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(name: &str) -> BuildArgs {
        BuildArgs {
            name: name.into(),
            debootstrap: None,
            packages: vec![],
            mirror: None,
            oci: None,
            dir: None,
            extra_mib: 0,
            node: String::new(),
        }
    }

    #[test]
    fn recipes() {
        use npb::import_template_request::Source;
        let r = recipe(&args("base")).unwrap();
        assert!(matches!(r.source, Some(Source::Debootstrap(d)) if d.suite.is_empty()));
        let e = recipe(&args("py")).unwrap_err().to_string();
        assert!(e.contains("--debootstrap SUITE"), "{e}");
        let mut a = args("py");
        a.dir = Some(".".into());
        match recipe(&a).unwrap().source {
            Some(Source::Directory(p)) => assert!(Path::new(&p).is_absolute()),
            s => panic!("{s:?}"),
        }
        a.dir = Some("no/such/dir".into());
        assert!(recipe(&a).unwrap_err().to_string().contains("no/such/dir"));
        a.dir = Some("/on/the/node".into());
        assert!(recipe(&a).is_ok());
    }
}
