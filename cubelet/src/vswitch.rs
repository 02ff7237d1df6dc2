//! The cube-vs switch behind cubelet's [`NetworkHook`]: ports are attached at pool-fill time,
//! bound to a per-sandbox host address from the node-local pool (plus egress policy and exposed
//! ports) when a sandbox claims its endpoint, and unbound, detached and their address released
//! when the endpoint goes. The switch's maps and filters are pinned, so a killed cubelet leaves
//! enforcement in place; the next one re-adopts it ([`NetworkHook::readopt`]).

use crate::network::{Endpoint, NetworkHook, Policy};
use cube_vs::{AddrPool, EgressPolicy, Ipv4Cidr, Port, SandboxNet, Switch, SwitchConfig};
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

use crate::egress_proxy::{NameSet, Registry};

struct Inner {
    sw: Switch,
    pool: AddrPool,
    /// ifindex → host address of every bound port.
    bound: HashMap<u32, Ipv4Addr>,
}

impl Inner {
    /// Unbinds a port and gives its host address back to the pool.
    fn unbind(&mut self, port: &Port) -> Result<(), cube_vs::Error> {
        if let Some(a) = self.bound.remove(&port.ifindex) {
            self.pool.release(a);
        }
        if let Some(a) = self.sw.unbind(port)? {
            self.pool.release(a);
        }
        Ok(())
    }
}

/// [`NetworkHook`] backed by a [`cube_vs::Switch`].
pub struct VsHook {
    inner: Mutex<Inner>,
    /// Guest ports the edge may always open (envd, the code interpreter, the agent's port).
    base_ports: Vec<u16>,
    /// The only DNS server sandboxes may query (while their internet is on).
    resolver: Option<Ipv4Addr>,
    /// The names each bound sandbox may reach through the egress proxy; `None` when the node
    /// runs none (then a policy with names is refused).
    names: Option<Arc<Registry>>,
}

fn port_of(ep: &Endpoint) -> Port {
    Port {
        ifindex: ep.host_ifindex,
        ifname: ep.host_if.clone(),
    }
}

/// Translates cubelet's policy record into the switch's. IPv6 entries are skipped: the switch
/// drops all IPv6, so an IPv6 deny is already in force and an IPv6 allow cannot be honoured.
pub fn egress_policy(p: &Policy) -> Result<EgressPolicy, String> {
    let parse = |v: &[String]| -> Result<Vec<Ipv4Cidr>, String> {
        let mut out = Vec::new();
        for c in v {
            if c.contains(':') {
                tracing::warn!(cidr = %c, "IPv6 policy entry ignored: sandboxes have no IPv6");
                continue;
            }
            out.push(
                c.parse::<Ipv4Cidr>()
                    .map_err(|e| format!("policy entry {c:?}: {e}"))?,
            );
        }
        Ok(out)
    };
    let host_services = p
        .host_services
        .iter()
        .map(|a| {
            a.parse::<Ipv4Addr>()
                .map_err(|e| format!("host service {a:?}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    Ok(EgressPolicy {
        internet: p.internet,
        allow: parse(&p.allow_cidrs)?,
        deny: parse(&p.deny_cidrs)?,
        dns_resolver: None,
        host_services,
        proxy_names: !p.allow_names.is_empty(),
        dns: p.dns,
    })
}

impl VsHook {
    /// Opens (or re-adopts) the switch. `agent_port` is always exposed besides
    /// [`cube_vs::DEFAULT_EXPOSED_PORTS`].
    pub fn open(
        cfg: SwitchConfig,
        agent_port: u16,
        resolver: Option<Ipv4Addr>,
        names: Option<Arc<Registry>>,
    ) -> Result<VsHook, cube_vs::Error> {
        let pool = AddrPool::new(cfg.host_pool)?;
        let sw = Switch::open(cfg)?;
        let mut base_ports = cube_vs::DEFAULT_EXPOSED_PORTS.to_vec();
        if !base_ports.contains(&agent_port) {
            base_ports.push(agent_port);
        }
        Ok(VsHook {
            inner: Mutex::new(Inner {
                sw,
                pool,
                bound: HashMap::new(),
            }),
            base_ports,
            resolver,
            names,
        })
    }

    /// Points the proxy at a sandbox's names (before its rules send it anything); returns
    /// what it had, for [`VsHook::restore_names`] if the switch then refuses the rules.
    fn set_names(&self, addr: Ipv4Addr, policy: &Policy) -> Result<Option<Arc<NameSet>>, String> {
        let names = NameSet::parse(&policy.allow_names)?;
        match &self.names {
            Some(reg) => Ok(reg.set(addr, names)),
            None if names.is_empty() => Ok(None),
            None => Err(
                "this node runs no egress proxy (network.egress_proxy is unset), so \
                         domain names cannot be allowed"
                    .into(),
            ),
        }
    }

    fn restore_names(&self, addr: Ipv4Addr, old: Option<Arc<NameSet>>) {
        if let Some(reg) = &self.names {
            reg.restore(addr, old);
        }
    }

    fn forget_names(&self, addr: Option<Ipv4Addr>) {
        if let (Some(reg), Some(a)) = (&self.names, addr) {
            reg.remove(a);
        }
    }

    fn egress(&self, policy: &Policy) -> Result<EgressPolicy, String> {
        Ok(EgressPolicy {
            dns_resolver: self.resolver,
            ..egress_policy(policy)?
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn net(&self, addr: Ipv4Addr, policy: &Policy) -> Result<SandboxNet, String> {
        let mut ports = if policy.all_ports {
            vec![cube_vs::ANY_PORT]
        } else {
            let mut p = self.base_ports.clone();
            p.extend(policy.exposed_ports.iter().copied());
            p
        };
        ports.sort_unstable();
        ports.dedup();
        Ok(SandboxNet {
            host_addr: addr,
            policy: self.egress(policy)?,
            exposed_ports: ports,
        })
    }

    /// Addresses in use (for tests and diagnostics).
    pub fn addresses_in_use(&self) -> Vec<Ipv4Addr> {
        self.lock().pool.in_use()
    }
}

impl NetworkHook for VsHook {
    fn isolates(&self) -> bool {
        true
    }

    fn endpoint_created(&self, ep: &Endpoint) -> Result<(), String> {
        let port = self
            .lock()
            .sw
            .attach(&ep.host_if)
            .map_err(|e| format!("attaching cube-vs to {}: {e}", ep.host_if))?;
        if port.ifindex != ep.host_ifindex {
            return Err(format!(
                "{} has index {} (expected {})",
                ep.host_if, port.ifindex, ep.host_ifindex
            ));
        }
        Ok(())
    }

    fn apply_policy(&self, ep: &Endpoint, policy: &Policy) -> Result<Option<Ipv4Addr>, String> {
        let port = port_of(ep);
        let mut g = self.lock();
        if let Some(&addr) = g.bound.get(&ep.host_ifindex) {
            // Already bound (a pre-started sandbox being claimed): same address, new rules.
            let net = self.net(addr, policy)?;
            let old = self.set_names(addr, policy)?;
            let r =
                g.sw.set_policy(&port, &net.policy)
                    .map_err(|e| format!("policy of {}: {e}", ep.host_if))
                    .and_then(|()| {
                        g.sw.set_exposed_ports(&port, &net.exposed_ports)
                            .map_err(|e| format!("exposed ports of {}: {e}", ep.host_if))
                    });
            if r.is_err() {
                self.restore_names(addr, old);
            }
            return r.map(|()| Some(addr));
        }
        let addr = g.pool.allocate().map_err(|e| e.to_string())?;
        let r = self.net(addr, policy).and_then(|net| {
            let old = self.set_names(addr, policy)?;
            g.sw.bind(&port, &net).map_err(|e| {
                self.restore_names(addr, old);
                e.to_string()
            })
        });
        match r {
            Ok(()) => {
                g.bound.insert(ep.host_ifindex, addr);
                Ok(Some(addr))
            }
            Err(e) => {
                g.pool.release(addr);
                Err(format!("binding {} to {addr}: {e}", ep.host_if))
            }
        }
    }

    fn update_policy(&self, ep: &Endpoint, policy: &Policy) -> Result<(), String> {
        let e = self.egress(policy)?;
        let mut g = self.lock();
        let Some(&addr) = g.bound.get(&ep.host_ifindex) else {
            return Err(format!("{} is not bound to a sandbox", ep.host_if));
        };
        let old = self.set_names(addr, policy)?;
        let r =
            g.sw.set_policy(&port_of(ep), &e)
                .map_err(|e| format!("policy of {}: {e}", ep.host_if));
        if r.is_err() {
            self.restore_names(addr, old);
        }
        r
    }

    fn endpoint_released(&self, ep: &Endpoint) {
        if ep.host_ifindex == 0 {
            return;
        }
        let port = port_of(ep);
        let mut g = self.lock();
        self.forget_names(g.bound.get(&ep.host_ifindex).copied());
        match g.unbind(&port) {
            Ok(()) | Err(cube_vs::Error::NotAttached(_)) => {}
            Err(e) => tracing::error!(host_if = %ep.host_if, error = %e, "cube-vs unbind"),
        }
        match g.sw.detach(&port) {
            Ok(()) | Err(cube_vs::Error::NotAttached(_)) => {}
            Err(e) => tracing::error!(host_if = %ep.host_if, error = %e, "cube-vs detach"),
        }
    }

    fn endpoint_recycled(&self, ep: &Endpoint) -> Result<(), String> {
        let mut g = self.lock();
        self.forget_names(g.bound.get(&ep.host_ifindex).copied());
        g.unbind(&port_of(ep))
            .map_err(|e| format!("cube-vs unbind of {}: {e}", ep.host_if))
    }

    fn readopt(
        &self,
        live: &[(Endpoint, Option<Ipv4Addr>, Policy)],
    ) -> Result<HashMap<u32, Ipv4Addr>, String> {
        let mut g = self.lock();
        let adopted: HashMap<u32, Option<Ipv4Addr>> =
            g.sw.adopt_existing()
                .into_iter()
                .map(|p| (p.port.ifindex, p.host_addr))
                .collect();
        let mut keep = std::collections::HashSet::new();
        // Reserve every recorded address first, so a rebind below cannot take one of them.
        for (_, addr, _) in live {
            if let Some(a) = addr {
                if let Err(e) = g.pool.mark_in_use(*a) {
                    tracing::warn!(addr = %a, error = %e, "recorded host address is not in the pool");
                }
            }
        }
        for (ep, addr, policy) in live {
            keep.insert(ep.host_ifindex);
            let port = port_of(ep);
            match (adopted.get(&ep.host_ifindex).copied().flatten(), addr) {
                (Some(found), Some(rec)) if found == *rec => {
                    g.bound.insert(ep.host_ifindex, found);
                    if let Err(e) = self.set_names(found, policy) {
                        tracing::error!(host_if = %ep.host_if, error = %e, "allowed names not re-adopted");
                    }
                }
                (found, rec) => {
                    // The pinned state lost this port (or disagrees with our record): put it
                    // back with the recorded address, so the sandbox keeps its identity. A
                    // failure costs this sandbox its network, not the node its daemon.
                    tracing::warn!(host_if = %ep.host_if, ?found, ?rec, "re-binding sandbox port");
                    let r = (|| -> Result<Ipv4Addr, String> {
                        g.sw.attach(&ep.host_if)
                            .map_err(|e| format!("re-attaching {}: {e}", ep.host_if))?;
                        let a = match rec {
                            Some(a) => *a,
                            None => g.pool.allocate().map_err(|e| e.to_string())?,
                        };
                        let net = self.net(a, policy)?;
                        self.set_names(a, policy)?;
                        g.sw.bind(&port, &net)
                            .map_err(|e| format!("re-binding {}: {e}", ep.host_if))?;
                        Ok(a)
                    })();
                    match r {
                        Ok(a) => {
                            g.bound.insert(ep.host_ifindex, a);
                        }
                        Err(e) => {
                            tracing::error!(host_if = %ep.host_if, error = %e, "sandbox has no network after re-adoption")
                        }
                    }
                }
            }
        }
        // Ports no live sandbox owns: pool entries and sandboxes reaped while we were down.
        for (&ifindex, &addr) in &adopted {
            if keep.contains(&ifindex) {
                continue;
            }
            let ifname = cube_vs_ifname(ifindex);
            tracing::info!(
                ifindex,
                ?ifname,
                ?addr,
                "releasing switch port no sandbox owns"
            );
            let port = Port {
                ifindex,
                ifname: ifname.unwrap_or_default(),
            };
            if let Err(e) = g.sw.detach(&port) {
                tracing::warn!(ifindex, error = %e, "detaching stale port");
            }
            if let Some(a) = addr {
                g.pool.release(a);
            }
        }
        tracing::info!(
            sandboxes = live.len(),
            addresses = g.pool.used(),
            "cube-vs state re-adopted"
        );
        Ok(g.bound.clone())
    }

    fn counters(&self, ep: &Endpoint) -> Option<cube_vs::Counters> {
        self.lock().sw.counters(ep.host_ifindex).ok()
    }
}

fn cube_vs_ifname(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname wrote a NUL-terminated string into buf.
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Some(s.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_translation() {
        let p = Policy {
            internet: false,
            allow_cidrs: vec!["198.18.0.1/32".into(), "fd00::/8".into()],
            deny_cidrs: vec!["8.8.0.0/16".into()],
            exposed_ports: vec![8080],
            all_ports: false,
            host_services: vec!["198.18.0.9".into()],
            allow_names: vec![],
            dns: false,
        };
        let e = egress_policy(&p).unwrap();
        assert!(!e.internet && !e.proxy_names && !e.dns);
        let named = Policy {
            allow_names: vec!["api.example.com".into()],
            dns: true,
            ..p.clone()
        };
        let n = egress_policy(&named).unwrap();
        assert!(n.proxy_names && n.dns);
        assert_eq!(e.allow.len(), 1);
        assert_eq!(e.allow[0].to_string(), "198.18.0.1/32");
        assert_eq!(e.deny[0].to_string(), "8.8.0.0/16");
        assert_eq!(e.host_services, vec![Ipv4Addr::new(198, 18, 0, 9)]);
        let bad = Policy {
            allow_cidrs: vec!["1.2.3.4/99".into()],
            ..Default::default()
        };
        assert!(egress_policy(&bad).is_err());
    }
}
