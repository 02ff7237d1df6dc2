//! Placement as a pure function over node views: filter (ready, not cordoned, template
//! present, sandbox cap, memory headroom), then score (warm pool for the template, free slots,
//! free memory, spread by in-flight creates). No I/O, no locks: `benches/sched-bench` times
//! exactly this code.

/// Why no node fits.
#[derive(Debug, PartialEq, Eq)]
pub enum NoFit {
    NoReadyNode,
    NoTemplate,
    NoCapacity,
}

/// What the scheduler sees of one node (borrowed from the node registry, nothing copied).
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    pub ready: bool,
    pub cordoned: bool,
    /// Sandboxes on the node plus creates already sent to it and not yet reflected.
    pub sandboxes: u32,
    /// Creates finished on the node since its count was measured. They only weigh in the
    /// spreading score, not the capacity filter: kills since then are not known either.
    pub recent: u32,
    /// 0 = no declared limit.
    pub max_sandboxes: u32,
    /// Memory still available for sandboxes, MiB; 0 = unknown (not filtered on).
    pub free_memory_mib: u64,
    pub total_memory_mib: u64,
    pub templates: &'a [String],
    /// Templates with pre-started or pre-cloned pool entries ready on the node.
    pub warm_templates: &'a [String],
}

/// One placement request.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub template: &'a str,
    pub memory_mib: u64,
}

// Score weights: a warm pool saves most of the create path, then capacity, then memory.
const W_WARM: f64 = 2.0;
const W_SLOTS: f64 = 1.0;
const W_MEMORY: f64 = 0.5;

/// Indices of the nodes that can take the sandbox, best first (ties broken by index, so the
/// result is deterministic for the same input).
pub fn rank(nodes: &[NodeView<'_>], req: &Request<'_>) -> Result<Vec<usize>, NoFit> {
    let mut any_ready = false;
    let mut any_template = false;
    let mut fit: Vec<(f64, usize)> = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if !n.ready || n.cordoned {
            continue;
        }
        any_ready = true;
        if !n.templates.iter().any(|t| t == req.template) {
            continue;
        }
        any_template = true;
        if let Some(s) = score(n, req) {
            fit.push((s, i));
        }
    }
    if fit.is_empty() {
        return Err(if !any_ready {
            NoFit::NoReadyNode
        } else if !any_template {
            NoFit::NoTemplate
        } else {
            NoFit::NoCapacity
        });
    }
    fit.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    Ok(fit.into_iter().map(|(_, i)| i).collect())
}

/// The node's score for this request, or `None` when it has no room.
fn score(n: &NodeView<'_>, req: &Request<'_>) -> Option<f64> {
    let load = n.sandboxes.saturating_add(n.recent);
    let slots = if n.max_sandboxes == 0 {
        // No declared limit: fewer sandboxes is better (spread).
        1.0 / (1.0 + load as f64)
    } else {
        if n.sandboxes >= n.max_sandboxes {
            return None;
        }
        n.max_sandboxes.saturating_sub(load) as f64 / n.max_sandboxes as f64
    };
    let memory = if n.free_memory_mib == 0 {
        0.5
    } else {
        if n.free_memory_mib < req.memory_mib {
            return None;
        }
        if n.total_memory_mib == 0 {
            0.5
        } else {
            (n.free_memory_mib as f64 / n.total_memory_mib as f64).min(1.0)
        }
    };
    let warm = if n.warm_templates.iter().any(|t| t == req.template) {
        1.0
    } else {
        0.0
    };
    Some(W_WARM * warm + W_SLOTS * slots + W_MEMORY * memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct N {
        ready: bool,
        cordoned: bool,
        running: u32,
        max: u32,
        free: u64,
        templates: Vec<String>,
        warm: Vec<String>,
    }

    fn n(ready: bool, templates: &[&str], running: u32, max: u32) -> N {
        N {
            ready,
            cordoned: false,
            running,
            max,
            free: 0,
            templates: templates.iter().map(|s| s.to_string()).collect(),
            warm: vec![],
        }
    }

    fn views(ns: &[N]) -> Vec<NodeView<'_>> {
        ns.iter()
            .map(|n| NodeView {
                ready: n.ready,
                cordoned: n.cordoned,
                sandboxes: n.running,
                recent: 0,
                max_sandboxes: n.max,
                free_memory_mib: n.free,
                total_memory_mib: 16384,
                templates: &n.templates,
                warm_templates: &n.warm,
            })
            .collect()
    }

    fn req(t: &str) -> Request<'_> {
        Request {
            template: t,
            memory_mib: 512,
        }
    }

    #[test]
    fn recent_creates_spread_but_do_not_fill() {
        let ns = vec![n(true, &["base"], 3, 10), n(true, &["base"], 3, 10)];
        let mut v = views(&ns);
        v[0].recent = 2;
        assert_eq!(rank(&v, &req("base")).unwrap(), vec![1, 0]);
        // Kills since the last count are unknown too: recent creates never make a node full.
        v[1].sandboxes = 9;
        v[1].recent = 5;
        assert_eq!(rank(&v, &req("base")).unwrap().len(), 2);
    }

    #[test]
    fn filters_and_scores() {
        let ns = vec![
            n(true, &["base"], 9, 10),
            n(true, &["base"], 2, 10),
            n(false, &["base"], 0, 10),
            n(true, &["other"], 0, 10),
            n(true, &["base"], 10, 10),
        ];
        let v = views(&ns);
        assert_eq!(rank(&v, &req("base")).unwrap(), [1, 0]);
        assert_eq!(rank(&v, &req("nope")).unwrap_err(), NoFit::NoTemplate);
        assert_eq!(
            rank(&v[2..3], &req("base")).unwrap_err(),
            NoFit::NoReadyNode
        );
        assert_eq!(rank(&v[4..5], &req("base")).unwrap_err(), NoFit::NoCapacity);
        assert_eq!(rank(&[], &req("base")).unwrap_err(), NoFit::NoReadyNode);
    }

    #[test]
    fn cordoned_nodes_are_skipped() {
        let mut ns = vec![n(true, &["base"], 0, 10), n(true, &["base"], 5, 10)];
        ns[0].cordoned = true;
        assert_eq!(rank(&views(&ns), &req("base")).unwrap(), [1]);
        ns[1].cordoned = true;
        // Every node cordoned reads as "no ready node" (nothing can take new sandboxes).
        assert_eq!(
            rank(&views(&ns), &req("base")).unwrap_err(),
            NoFit::NoReadyNode
        );
    }

    #[test]
    fn memory_headroom_and_warm_pools() {
        let mut ns = vec![
            n(true, &["base"], 0, 0),
            n(true, &["base"], 0, 0),
            n(true, &["base"], 0, 0),
        ];
        ns[0].free = 100; // too little for 512 MiB
        ns[1].free = 8192;
        ns[2].free = 8192;
        ns[2].warm = vec!["base".into()];
        assert_eq!(rank(&views(&ns), &req("base")).unwrap(), [2, 1]);
        ns[1].free = 0; // unknown: not filtered
        ns[2].free = 10;
        assert_eq!(rank(&views(&ns), &req("base")).unwrap(), [1]);
    }

    #[test]
    fn unlimited_nodes_spread_by_load() {
        let ns = vec![
            n(true, &["base"], 7, 0),
            n(true, &["base"], 1, 0),
            n(true, &["base"], 3, 0),
        ];
        assert_eq!(rank(&views(&ns), &req("base")).unwrap(), [1, 2, 0]);
    }
}
