//! Placement: filter (ready, capacity, template present), then score by free capacity.

use crate::nodes::Node;

/// Why no node fits.
#[derive(Debug, PartialEq, Eq)]
pub enum NoFit {
    NoReadyNode,
    NoTemplate,
    NoCapacity,
}

/// Nodes that can take a sandbox of `template`, best first.
pub fn candidates(nodes: &[Node], template: &str) -> Result<Vec<Node>, NoFit> {
    let ready: Vec<&Node> = nodes
        .iter()
        .filter(|n| n.ready && n.status.is_some())
        .collect();
    if ready.is_empty() {
        return Err(NoFit::NoReadyNode);
    }
    let with_template: Vec<&Node> = ready
        .into_iter()
        .filter(|n| {
            n.status
                .as_ref()
                .is_some_and(|s| s.templates.iter().any(|t| t == template))
        })
        .collect();
    if with_template.is_empty() {
        return Err(NoFit::NoTemplate);
    }
    let mut fit: Vec<(f64, &Node)> = with_template
        .into_iter()
        .filter_map(|n| {
            let s = n.status.as_ref()?;
            let max = s.capacity.as_ref().map(|c| c.max_sandboxes).unwrap_or(0);
            if max == 0 {
                // No declared limit: score by how few sandboxes it runs.
                return Some((1.0 / (1.0 + s.sandboxes as f64), n));
            }
            if s.sandboxes >= max {
                return None;
            }
            Some(((max - s.sandboxes) as f64 / max as f64, n))
        })
        .collect();
    if fit.is_empty() {
        return Err(NoFit::NoCapacity);
    }
    fit.sort_by(|a, b| b.0.total_cmp(&a.0));
    Ok(fit.into_iter().map(|(_, n)| n.clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cube_proto::nodev1::node_client::NodeClient;
    use cube_proto::nodev1::{Capacity, NodeStatusResponse};

    fn node(addr: &str, ready: bool, templates: &[&str], running: u32, max: u32) -> Node {
        let ch = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        Node {
            address: addr.into(),
            client: NodeClient::new(ch),
            status: Some(NodeStatusResponse {
                node_id: addr.into(),
                sandboxes: running,
                templates: templates.iter().map(|s| s.to_string()).collect(),
                capacity: Some(Capacity {
                    max_sandboxes: max,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            misses: 0,
            ready,
        }
    }

    #[tokio::test]
    async fn filters_and_scores() {
        let ns = vec![
            node("a", true, &["base"], 9, 10),
            node("b", true, &["base"], 2, 10),
            node("c", false, &["base"], 0, 10),
            node("d", true, &["other"], 0, 10),
            node("e", true, &["base"], 10, 10),
        ];
        let c = candidates(&ns, "base").unwrap();
        let ids: Vec<_> = c.iter().map(|n| n.address.as_str()).collect();
        assert_eq!(ids, ["b", "a"]);
        assert_eq!(candidates(&ns, "nope").unwrap_err(), NoFit::NoTemplate);
        assert_eq!(
            candidates(&ns[2..3], "base").unwrap_err(),
            NoFit::NoReadyNode
        );
        assert_eq!(
            candidates(&ns[4..5], "base").unwrap_err(),
            NoFit::NoCapacity
        );
    }
}
