//! The daemons' configuration files for a single-host install, written into the data directory
//! from embedded defaults at the first `up`. Later `up`s keep them, so an operator's edits stay.

use crate::layout::Layout;
use std::path::Path;

fn q(p: &Path) -> String {
    // TOML basic string: escape backslash and quote.
    format!(
        "\"{}\"",
        p.display()
            .to_string()
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
    )
}

pub fn cubelet(l: &Layout, agent: &Path, pool: u32) -> String {
    let storage = match &l.xfs_loop_image {
        Some(img) => format!(
            "# The data directory is not on XFS: reflink clones come from this loop-mounted image.\n\
             xfs_loop_image = {}\nxfs_loop_size_gib = {}\n",
            q(img),
            l.xfs_loop_size_gib
        ),
        None => "# The data directory is on XFS: reflink clones work in place.\n".to_string(),
    };
    format!(
        "# cubelet configuration written by `cubectl up` (edits are kept by later `up`s).\n\
         grpc_addr = \"127.0.0.1:{grpc}\"\n\
         http_addr = \"127.0.0.1:{http}\"\n\
         data_dir = {data}\n\
         run_dir = {run}\n\
         agent_binary = {agent}\n\
         runtime = \"{runtime}\"\n\
         \n[storage]\n{storage}\
         \n[cgroup]\nparent = \"{cg}\"\n\
         \n[pools.started]\n# Sandboxes kept started and waiting for /init, per template.\nbase = {pool}\n\
         \n[network]\n\
         # The egress proxy that admits the domain names a sandbox may reach (unset: refused).\n\
         egress_proxy = \"169.254.64.1\"\n\
         \n[switch]\n\
         host_pool = \"{pool_net}\"\n\
         pin_root = {pins}\n\
         nft_table = \"{nft}\"\n",
        grpc = l.ports.cubelet_grpc,
        http = l.ports.cubelet_metrics,
        data = q(&l.node_dir),
        run = q(&l.run_dir),
        agent = q(agent),
        runtime = l.runtime,
        cg = l.cgroup_parent,
        pool_net = l.switch.host_pool,
        pins = q(&l.switch.pin_root),
        nft = l.switch.nft_table,
    )
}

pub fn master(l: &Layout) -> String {
    format!(
        "# cube-master configuration written by `cubectl up` (edits are kept by later `up`s).\n\
         grpc_addr = \"127.0.0.1:{grpc}\"\n\
         database_url = \"sqlite://{db}?mode=rwc\"\n\
         nodes = [\"{node}\"]\n\
         metrics_addr = \"127.0.0.1:{metrics}\"\n",
        grpc = l.ports.master_grpc,
        db = l.data_dir.join("master.db").display(),
        node = l.cubelet_url(),
        metrics = l.ports.master_metrics,
    )
}

pub fn api(l: &Layout) -> String {
    format!(
        "# cube-api configuration written by `cubectl up` (edits are kept by later `up`s).\n\
         api_addr = \"127.0.0.1:{api}\"\n\
         edge_addr = \"127.0.0.1:{edge}\"\n\
         master_url = \"{master}\"\n\
         metrics_addr = \"127.0.0.1:{metrics}\"\n",
        api = l.ports.api,
        edge = l.ports.edge,
        master = l.master_url(),
        metrics = l.ports.api_metrics,
    )
}

/// Sets (or with `None` removes) a top-level key in a TOML file, keeping the other keys.
pub fn edit_key(path: &Path, key: &str, value: Option<toml::Value>) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let mut t: toml::Table =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("parsing {}: {e}", path.display()))?;
    match value {
        Some(v) => {
            t.insert(key.to_string(), v);
        }
        None => {
            t.remove(key);
        }
    }
    let header: String = text
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(path, format!("{header}{}", toml::to_string(&t)?))
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{pick_ports, Switch, FORMAT};

    fn layout() -> Layout {
        Layout {
            format: FORMAT,
            data_dir: "/var/tmp/d x".into(),
            run_dir: "/run/cube-1".into(),
            node_dir: "/var/tmp/d x/node".into(),
            xfs_loop_image: Some("/var/tmp/d x/node.xfs".into()),
            xfs_loop_size_gib: 4,
            runtime: "namespace".into(),
            cgroup_parent: "cube-1".into(),
            ports: pick_ports(4300, &|_| true).unwrap(),
            switch: Switch {
                pin_root: "/sys/fs/bpf/cube-1".into(),
                nft_table: "cube_1".into(),
                host_pool: "10.234.1.0/24".into(),
            },
            checksum: String::new(),
        }
    }

    #[test]
    fn configs_are_valid_toml_with_our_settings() {
        let l = layout();
        let c: toml::Table = toml::from_str(&cubelet(&l, Path::new("/a/cube-agent"), 2)).unwrap();
        assert_eq!(c["grpc_addr"].as_str(), Some("127.0.0.1:4303"));
        assert_eq!(c["data_dir"].as_str(), Some("/var/tmp/d x/node"));
        assert_eq!(c["switch"]["nft_table"].as_str(), Some("cube_1"));
        assert_eq!(c["pools"]["started"]["base"].as_integer(), Some(2));
        assert_eq!(c["storage"]["xfs_loop_size_gib"].as_integer(), Some(4));
        let m: toml::Table = toml::from_str(&master(&l)).unwrap();
        assert_eq!(m["nodes"][0].as_str(), Some("http://127.0.0.1:4303"));
        let a: toml::Table = toml::from_str(&api(&l)).unwrap();
        assert_eq!(a["edge_addr"].as_str(), Some("127.0.0.1:4301"));
        assert_eq!(a["master_url"].as_str(), Some("http://127.0.0.1:4302"));
    }

    #[test]
    fn edits_keys() {
        let p = std::env::temp_dir().join(format!("cubectl-cfg-{}.toml", std::process::id()));
        std::fs::write(&p, "# head\na = 1\nmetrics_addr = \"x\"\n[t]\nb = 2\n").unwrap();
        edit_key(&p, "metrics_addr", None).unwrap();
        edit_key(&p, "runtime", Some("namespace".into())).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.starts_with("# head\n"), "{text}");
        let t: toml::Table = toml::from_str(&text).unwrap();
        assert!(t.get("metrics_addr").is_none());
        assert_eq!(t["runtime"].as_str(), Some("namespace"));
        assert_eq!(t["t"]["b"].as_integer(), Some(2));
        std::fs::remove_file(&p).unwrap();
    }
}
