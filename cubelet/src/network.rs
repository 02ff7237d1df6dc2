//! Per-sandbox network endpoints for the namespace runtime: a network namespace (bind-mounted
//! under the run directory so it outlives its processes) and a veth pair whose guest end is
//! `eth0` with the fixed guest identity, and whose host end has the gateway MAC (and, only
//! without a switch, the gateway address).
//!
//! cube-vs plugs in through [`NetworkHook`] (implemented in `crate::vswitch`): it is called
//! after the veth exists and before the endpoint is handed to a sandbox, when a policy is
//! applied, and before the endpoint is torn down.

use futures::TryStreamExt;
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkInfo, LinkMessage,
};
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// A netlink handle inside a sandbox's network namespace (between
/// [`Network::create_netns_only`] and [`Network::wire_netns`]).
pub struct NsHandle(rtnetlink::Handle);

/// Errors of endpoint management.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("netlink: {what}: {source}")]
    Netlink {
        what: String,
        source: Box<rtnetlink::Error>,
    },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("link {0} not found")]
    NoLink(String),
    #[error("network hook: {0}")]
    Hook(String),
}

fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetError {
    let what = what.into();
    move |source| NetError::Netlink {
        what,
        source: Box::new(source),
    }
}

/// The fixed guest identity shared by every sandbox (see ARCHITECTURE.md).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct GuestIdentity {
    pub guest_ip: Ipv4Addr,
    pub gateway_ip: Ipv4Addr,
    pub prefix_len: u8,
    pub guest_mac: [u8; 6],
    pub gateway_mac: [u8; 6],
}

impl Default for GuestIdentity {
    fn default() -> Self {
        GuestIdentity {
            guest_ip: Ipv4Addr::new(169, 254, 77, 2),
            gateway_ip: Ipv4Addr::new(169, 254, 77, 1),
            prefix_len: 30,
            guest_mac: [0x02, 0xcb, 0xe0, 0, 0, 2],
            gateway_mac: [0x02, 0xcb, 0xe0, 0, 0, 1],
        }
    }
}

/// A ready network endpoint.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    pub key: String,
    pub netns_path: PathBuf,
    pub host_if: String,
    pub host_ifindex: u32,
}

/// Egress/ingress policy handed to the switch.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Policy {
    pub internet: bool,
    pub allow_cidrs: Vec<String>,
    pub deny_cidrs: Vec<String>,
    pub exposed_ports: Vec<u16>,
    /// Every guest port open to the node (E2B's public ports through the edge).
    #[serde(default)]
    pub all_ports: bool,
    /// Addresses of the node itself the sandbox may reach (an operator's choice; allow
    /// entries never open the node).
    #[serde(default)]
    pub host_services: Vec<String>,
    /// Domain names and `*.` wildcards the node's egress proxy admits TCP to.
    #[serde(default)]
    pub allow_names: Vec<String>,
    /// The node's resolver answers with internet off too (what `allow_names` need).
    #[serde(default)]
    pub dns: bool,
}

impl Policy {
    /// Whether it has egress entries, which only a switch can enforce.
    pub fn has_egress_rules(&self) -> bool {
        !(self.allow_cidrs.is_empty()
            && self.deny_cidrs.is_empty()
            && self.host_services.is_empty()
            && self.allow_names.is_empty())
    }
    /// This policy with its egress part replaced (ports and host services stay).
    pub fn with_egress(&self, e: Egress) -> Policy {
        Policy {
            internet: e.internet,
            allow_cidrs: e.allow_cidrs,
            deny_cidrs: e.deny_cidrs,
            allow_names: e.allow_names,
            dns: e.dns,
            ..self.clone()
        }
    }
}

/// The egress part of a [`Policy`]: what a network update replaces.
#[derive(Debug, Clone, Default)]
pub struct Egress {
    pub internet: bool,
    pub allow_cidrs: Vec<String>,
    pub deny_cidrs: Vec<String>,
    pub allow_names: Vec<String>,
    pub dns: bool,
}

/// Where the switch (cube-vs) plugs in. Every method runs off the create hot path except
/// `apply_policy`, which must be cheap (map updates and one route).
pub trait NetworkHook: Send + Sync + 'static {
    /// Whether sandboxes get isolated, per-sandbox host addresses. When false (no switch), the
    /// host end of every veth carries the gateway address and the host reaches a sandbox by
    /// binding to its interface (SO_BINDTODEVICE).
    fn isolates(&self) -> bool {
        false
    }
    /// After the veth pair exists and is configured, before the endpoint enters a pool or is
    /// handed to a sandbox (attach programs here).
    fn endpoint_created(&self, _ep: &Endpoint) -> Result<(), String> {
        Ok(())
    }
    /// When a sandbox (or a pre-started pool entry) claims the endpoint: bind it with its
    /// policy and exposed ports. Returns the sandbox's host address (the same one when the
    /// endpoint is already bound); `None` without a switch.
    fn apply_policy(&self, _ep: &Endpoint, _policy: &Policy) -> Result<Option<Ipv4Addr>, String> {
        Ok(None)
    }
    /// Replaces the egress part of a bound endpoint's policy (PUT /sandboxes/{id}/network);
    /// atomic: the datapath sees the old rules or the new ones. Without a switch there is
    /// nothing to enforce it, which is an error, not a silent success.
    fn update_policy(&self, _ep: &Endpoint, _policy: &Policy) -> Result<(), String> {
        Err(
            "this node has no switch (network.switch = \"none\"): egress rules cannot be enforced"
                .into(),
        )
    }
    /// Before the veth is deleted (unbind, detach, release the host address).
    fn endpoint_released(&self, _ep: &Endpoint) {}
    /// When a killed sandbox's endpoint goes back to the pool instead of being deleted:
    /// unbind it (release the host address, drop its rules and flows) but keep it attached.
    fn endpoint_recycled(&self, _ep: &Endpoint) -> Result<(), String> {
        Ok(())
    }
    /// After crash recovery, with the endpoints of the re-adopted sandboxes (and the host
    /// address and policy each had on record): keep those bound with the same addresses,
    /// release everything else the switch still holds. Returns the host address of each live
    /// endpoint by interface index (a sandbox recorded without one may have got one).
    fn readopt(
        &self,
        _live: &[(Endpoint, Option<Ipv4Addr>, Policy)],
    ) -> Result<std::collections::HashMap<u32, Ipv4Addr>, String> {
        Ok(Default::default())
    }
    /// Packet, byte and drop counters of an endpoint.
    fn counters(&self, _ep: &Endpoint) -> Option<cube_vs::Counters> {
        None
    }
}

/// No switch: policy is recorded but NOT enforced, and sandboxes can reach the host
/// (`network.switch = "none"`; cubelet logs a loud warning).
pub struct NoSwitch;
impl NetworkHook for NoSwitch {}

/// `statfs` type of a bind-mounted namespace file (linux/magic.h).
const NSFS_MAGIC: libc::__fsword_t = 0x6e73_6673;

/// Host interface name prefix; every link with it belongs to cubelet (orphan reaping).
pub const HOST_IF_PREFIX: &str = "cvh";

/// Creates and deletes endpoints.
pub struct Network {
    handle: rtnetlink::Handle,
    netns_dir: PathBuf,
    identity: GuestIdentity,
    hook: std::sync::Arc<dyn NetworkHook>,
}

fn cpath(p: &Path) -> std::ffi::CString {
    crate::storage::cstr(p)
}

impl Network {
    /// Opens a netlink connection in the caller's (host) network namespace. Must run inside a
    /// tokio runtime.
    pub fn new(
        netns_dir: &Path,
        identity: GuestIdentity,
        hook: std::sync::Arc<dyn NetworkHook>,
    ) -> Result<Network, NetError> {
        std::fs::create_dir_all(netns_dir).map_err(|e| NetError::Io {
            op: "mkdir",
            path: netns_dir.display().to_string(),
            source: e,
        })?;
        let (conn, handle, _) = rtnetlink::new_connection().map_err(|e| NetError::Io {
            op: "netlink socket",
            path: String::new(),
            source: e,
        })?;
        tokio::spawn(conn);
        Ok(Network {
            handle,
            netns_dir: netns_dir.to_path_buf(),
            identity,
            hook,
        })
    }

    pub fn hook(&self) -> &std::sync::Arc<dyn NetworkHook> {
        &self.hook
    }

    /// Host interface name for an endpoint key (≤ 15 bytes).
    pub fn host_if_name(key: &str) -> String {
        let k: String = key.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
        format!("{HOST_IF_PREFIX}{}", &k[..k.len().min(12)])
    }

    pub fn netns_path(&self, key: &str) -> PathBuf {
        self.netns_dir.join(key)
    }

    /// Creates a named network namespace and a netlink handle inside it.
    async fn create_netns(&self, path: &Path) -> Result<rtnetlink::Handle, NetError> {
        let path = path.to_path_buf();
        let rt = tokio::runtime::Handle::current();
        let (tx, rx) = tokio::sync::oneshot::channel();
        // A dedicated thread (it exits, taking the new namespace with it), awaited without
        // blocking the runtime so the concurrent parts of a create keep running.
        std::thread::spawn(move || {
            let _ = tx.send(netns_thread(path, rt));
        });
        rx.await
            .map_err(|_| NetError::Hook("netns thread panicked".into()))?
    }

    /// The endpoint record for `key` (names and paths; `host_ifindex` 0 until wired).
    pub fn endpoint_for(&self, key: &str) -> Endpoint {
        Endpoint {
            key: key.to_string(),
            netns_path: self.netns_path(key),
            host_if: Self::host_if_name(key),
            host_ifindex: 0,
        }
    }

    /// Creates a complete endpoint. On failure everything created so far is removed.
    pub async fn create(&self, key: &str) -> Result<Endpoint, NetError> {
        let ep = self.endpoint_for(key);
        let r = async {
            let nsh = self.create_netns(&ep.netns_path).await?;
            self.wire(ep.clone(), nsh).await
        }
        .await;
        if r.is_err() {
            self.destroy_parts(&ep.host_if, &ep.netns_path).await;
        }
        r
    }

    /// First half of [`Network::create`]: only the namespace, so a sandbox can be started in
    /// it while [`Network::wire`] adds the veth. On failure the caller must
    /// [`Network::destroy`] `ep` (idempotent).
    pub async fn create_netns_only(&self, ep: &Endpoint) -> Result<NsHandle, NetError> {
        Ok(NsHandle(self.create_netns(&ep.netns_path).await?))
    }

    /// Second half of [`Network::create`]: the veth pair, configured on both sides, and the
    /// hook. On failure the caller must [`Network::destroy`] `ep` (idempotent).
    pub async fn wire_netns(&self, ep: Endpoint, nsh: NsHandle) -> Result<Endpoint, NetError> {
        self.wire(ep, nsh.0).await
    }

    async fn wire(&self, mut ep: Endpoint, nsh: rtnetlink::Handle) -> Result<Endpoint, NetError> {
        let id = &self.identity;
        let h = &self.handle;
        let nsfile = std::fs::File::open(&ep.netns_path).map_err(|e| NetError::Io {
            op: "open",
            path: ep.netns_path.display().to_string(),
            source: e,
        })?;
        // One request creates both ends with their final names and MACs, the guest end
        // directly inside the namespace: moving a device between namespaces afterwards costs
        // an RCU grace period (tens of ms on a loaded host).
        let mut peer = LinkMessage::default();
        peer.attributes.push(LinkAttribute::IfName("eth0".into()));
        peer.attributes
            .push(LinkAttribute::Address(id.guest_mac.to_vec()));
        peer.attributes
            .push(LinkAttribute::NetNsFd(nsfile.as_raw_fd()));
        let mut add = h.link().add().name(ep.host_if.clone());
        add.message_mut()
            .attributes
            .push(LinkAttribute::Address(id.gateway_mac.to_vec()));
        add.message_mut()
            .attributes
            .push(LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Veth),
                LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
            ]));
        add.execute()
            .await
            .map_err(nl(format!("add veth {}", ep.host_if)))?;
        drop(nsfile);
        let host_idx = index_of(h, &ep.host_if)
            .await?
            .ok_or_else(|| NetError::NoLink(ep.host_if.clone()))?;
        ep.host_ifindex = host_idx;
        self.configure_guest(&nsh).await?;
        drop(nsh);
        self.host_end_up(ep, host_idx).await
    }

    async fn configure_guest(&self, nsh: &rtnetlink::Handle) -> Result<(), NetError> {
        configure_guest(nsh, &self.identity).await
    }

    /// A microVM's tap as an endpoint: the host end of the guest's virtio-net, configured and
    /// handed to the switch like a veth's host end (no namespace: the VM is the guest side).
    pub async fn tap_endpoint(&self, tap: &str) -> Result<Endpoint, NetError> {
        let h = &self.handle;
        let idx = index_of(h, tap)
            .await?
            .ok_or_else(|| NetError::NoLink(tap.to_string()))?;
        h.link()
            .set(idx)
            .address(self.identity.gateway_mac.to_vec())
            .execute()
            .await
            .map_err(nl(format!("{tap} address")))?;
        let ep = Endpoint {
            key: tap.to_string(),
            netns_path: PathBuf::new(),
            host_if: tap.to_string(),
            host_ifindex: idx,
        };
        self.host_end_up(ep, idx).await
    }

    async fn host_end_up(&self, ep: Endpoint, host_idx: u32) -> Result<Endpoint, NetError> {
        let (id, h) = (&self.identity, &self.handle);
        // Host side: the gateway MAC, and no address when a switch isolates sandboxes: the
        // switch answers ARP for the gateway and routes the sandbox's own host address to this
        // interface, so nothing on the host is reachable through an address of this link.
        // Without a switch every host end has the gateway address and the host reaches a given
        // sandbox by binding its socket to the interface (SO_BINDTODEVICE).
        if !self.hook.isolates() {
            h.address()
                .add(host_idx, IpAddr::V4(id.gateway_ip), id.prefix_len)
                .execute()
                .await
                .map_err(nl("gateway address"))?;
        }
        h.link()
            .set(host_idx)
            .up()
            .execute()
            .await
            .map_err(nl("host end up"))?;
        self.hook.endpoint_created(&ep).map_err(NetError::Hook)?;
        Ok(ep)
    }

    /// Deletes an endpoint. Idempotent; missing parts are fine.
    pub async fn destroy(&self, ep: &Endpoint) {
        self.hook.endpoint_released(ep);
        self.destroy_parts(&ep.host_if, &ep.netns_path).await;
    }

    /// Deletes by key (used for orphans, whose endpoint record may be gone).
    pub async fn destroy_key(&self, key: &str) {
        let host_if = Self::host_if_name(key);
        let path = self.netns_path(key);
        self.destroy_parts(&host_if, &path).await;
    }

    async fn destroy_parts(&self, host_if: &str, netns_path: &Path) {
        if let Ok(Some(idx)) = index_of(&self.handle, host_if).await {
            if let Err(e) = self.handle.link().del(idx).execute().await {
                tracing::warn!(host_if, error = %e, "deleting veth");
            }
        }
        if netns_path.as_os_str().is_empty() {
            return; // a microVM's tap
        }
        let c = cpath(netns_path);
        // SAFETY: valid C string; MNT_DETACH so a lingering user cannot block us.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_file(netns_path);
    }

    /// Names of all host links with our prefix (for orphan reaping).
    pub async fn list_host_links(&self) -> Result<Vec<String>, NetError> {
        let mut s = self.handle.link().get().execute();
        let mut out = Vec::new();
        while let Some(m) = s.try_next().await.map_err(nl("list links"))? {
            for a in &m.attributes {
                if let LinkAttribute::IfName(n) = a {
                    if n.starts_with(HOST_IF_PREFIX) {
                        out.push(n.clone());
                    }
                }
            }
        }
        Ok(out)
    }

    /// Whether an endpoint made earlier is still whole: its namespace file is still a mounted
    /// network namespace and its host link still has the index it had. A pooled endpoint can
    /// lose either under a running node (its run directory cleaned, a link deleted by hand).
    pub fn intact(ep: &Endpoint) -> bool {
        if !ep.netns_path.as_os_str().is_empty() {
            let c = cpath(&ep.netns_path);
            // SAFETY: valid C string and a local out-buffer.
            let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
            if unsafe { libc::statfs(c.as_ptr(), &mut fs) } != 0 || fs.f_type != NSFS_MAGIC {
                return false;
            }
        }
        if ep.host_ifindex != 0 {
            let Ok(name) = std::ffi::CString::new(ep.host_if.as_str()) else {
                return false;
            };
            // SAFETY: valid C string.
            if unsafe { libc::if_nametoindex(name.as_ptr()) } != ep.host_ifindex {
                return false;
            }
        }
        true
    }

    /// Keys of all namespace files (for orphan reaping).
    pub fn list_netns(&self) -> Vec<String> {
        std::fs::read_dir(&self.netns_dir)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The index of link `name` in the namespace of `h`, if there is one.
pub(crate) async fn index_of(h: &rtnetlink::Handle, name: &str) -> Result<Option<u32>, NetError> {
    let mut s = h.link().get().match_name(name.to_string()).execute();
    match s.try_next().await {
        Ok(Some(m)) => Ok(Some(m.header.index)),
        Ok(None) => Ok(None),
        // ENODEV: no such link.
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
        Err(e) => Err(nl(format!("get link {name}"))(e)),
    }
}

/// The guest side of an endpoint, through a netlink socket opened inside its namespace:
/// `eth0` and `lo` up, the guest address, the default route and the gateway's MAC. Parts
/// already there are kept.
pub(crate) async fn configure_guest(
    nsh: &rtnetlink::Handle,
    id: &GuestIdentity,
) -> Result<(), NetError> {
    // What a previous configuration left is fine.
    let exists = |what: &'static str| {
        move |e: rtnetlink::Error| match e {
            rtnetlink::Error::NetlinkError(m) if m.raw_code() == -libc::EEXIST => Ok(()),
            e => Err(nl(what)(e)),
        }
    };
    let gidx = index_of(nsh, "eth0")
        .await?
        .ok_or_else(|| NetError::NoLink("eth0".into()))?;
    nsh.link()
        .set(gidx)
        .up()
        .execute()
        .await
        .map_err(nl("eth0 up"))?;
    nsh.address()
        .add(gidx, IpAddr::V4(id.guest_ip), id.prefix_len)
        .execute()
        .await
        .or_else(exists("guest address"))?;
    if let Some(lo) = index_of(nsh, "lo").await? {
        nsh.link()
            .set(lo)
            .up()
            .execute()
            .await
            .map_err(nl("lo up"))?;
    }
    nsh.route()
        .add()
        .v4()
        .gateway(id.gateway_ip)
        .execute()
        .await
        .or_else(exists("default route"))?;
    // The gateway's MAC is fixed: a permanent entry saves the first ARP round trip and is
    // not counted against the kernel's ARP table limit, which every namespace shares.
    nsh.neighbours()
        .add(gidx, IpAddr::V4(id.gateway_ip))
        .link_local_address(&id.gateway_mac)
        .state(netlink_packet_route::neighbour::NeighbourState::Permanent)
        .replace()
        .execute()
        .await
        .map_err(nl("gateway neighbour"))?;
    Ok(())
}

/// Runs `f` with a netlink socket opened in the calling thread's network namespace, on an
/// async runtime of its own on this thread. For a thread outside any async runtime; it starts
/// no other thread (a launcher that joins a user namespace next must stay single-threaded).
fn with_netlink<T, F>(f: impl FnOnce(rtnetlink::Handle) -> F) -> Result<T, NetError>
where
    F: std::future::Future<Output = Result<T, NetError>>,
{
    let io = |op: &'static str| {
        move |source| NetError::Io {
            op,
            path: String::new(),
            source,
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(io("async runtime"))?;
    rt.block_on(async {
        let (conn, h, _) = rtnetlink::new_connection().map_err(io("netlink socket"))?;
        let conn = tokio::spawn(conn);
        let r = f(h).await;
        conn.abort();
        r
    })
}

/// Moves the guest end (`eth0`) from the calling thread's network namespace into `to`. Its
/// addresses and routes stay behind ([`address_guest_link`] there). Blocking: see
/// [`with_netlink`].
pub fn move_guest_link(to: &std::fs::File) -> Result<(), NetError> {
    let fd = to.as_raw_fd();
    with_netlink(|h| async move {
        let idx = index_of(&h, "eth0")
            .await?
            .ok_or_else(|| NetError::NoLink("eth0".into()))?;
        h.link()
            .set(idx)
            .setns_by_fd(fd)
            .execute()
            .await
            .map_err(nl("move eth0 to another namespace"))
    })
}

/// [`configure_guest`] in the calling thread's network namespace: a user-space network stack
/// (gVisor's) takes the addresses with it, so each start sets them again. Blocking: see
/// [`with_netlink`].
pub fn address_guest_link(id: &GuestIdentity) -> Result<(), NetError> {
    with_netlink(|h| async move { configure_guest(&h, id).await })
}

/// Bind-mounts the namespace file `ns` (`/proc/.../ns/net`, or an open one's
/// `/proc/self/fd/N`) at `at`, a new empty file: the namespace then outlives its processes and
/// has a path others can name.
pub(crate) fn pin_netns(ns: &Path, at: &Path) -> std::io::Result<()> {
    std::fs::File::create(at)?;
    crate::storage::bind_mount(ns, at)
}

/// Body of a netns thread: creates and bind-mounts a new network namespace at `path` and opens
/// a netlink socket inside it. The thread exits
/// right after; the socket stays in the namespace.
fn netns_thread(path: PathBuf, rt: tokio::runtime::Handle) -> Result<rtnetlink::Handle, NetError> {
    let ioe = |op: &'static str, p: &Path| {
        let path = p.display().to_string();
        move |source| NetError::Io { op, path, source }
    };
    // The run directory may have been removed under a running node (`cubectl down` of a node
    // it did not stop cleans it): make it again rather than fail every create.
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(ioe("create", dir))?;
    }
    // SAFETY: unshare affects only this thread, which exits right after.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(ioe("unshare(NEWNET)", &path)(
            std::io::Error::last_os_error(),
        ));
    }
    pin_netns(Path::new("/proc/thread-self/ns/net"), &path).map_err(ioe("bind netns", &path))?;
    let _g = rt.enter();
    let (conn, handle, _) = rtnetlink::new_connection().map_err(ioe("netlink socket", &path))?;
    rt.spawn(conn);
    Ok(handle)
}
