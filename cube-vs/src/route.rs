//! The host route `host_addr/32 dev <interface>` that sends a sandbox's traffic to its port,
//! and the permanent neighbour entry beside it, programmed over rtnetlink.
//!
//! The neighbour entry matters at scale: the kernel's ARP table is shared by every network
//! namespace and overflows at `gc_thresh3` (1,024 by default) *dynamic* entries, after which
//! new sandboxes are unreachable ("neighbor table overflow"). Permanent entries are not
//! counted, and the guest's MAC is known, so there is nothing to resolve anyway.

use std::net::Ipv4Addr;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE,
    NLM_F_REQUEST,
};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use crate::error::{Error, Result};

fn message(addr: Ipv4Addr, ifindex: u32) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet;
    m.header.destination_prefix_length = 32;
    m.header.table = RouteHeader::RT_TABLE_MAIN;
    m.header.protocol = RouteProtocol::Static;
    m.header.scope = RouteScope::Link;
    m.header.kind = RouteType::Unicast;
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::Inet(addr)));
    m.attributes.push(RouteAttribute::Oif(ifindex));
    m
}

fn request(msg: RouteNetlinkMessage, flags: u16) -> Result<()> {
    let mut hdr = NetlinkHeader::default();
    hdr.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
    let mut nl = NetlinkMessage::new(hdr, NetlinkPayload::InnerMessage(msg));
    nl.finalize();
    let mut buf = vec![0u8; nl.buffer_len()];
    nl.serialize(&mut buf);

    let nlerr = |what: &str, e: std::io::Error| Error::Netlink(format!("{what}: {e}"));
    let mut sock = Socket::new(NETLINK_ROUTE).map_err(|e| nlerr("socket", e))?;
    sock.bind_auto().map_err(|e| nlerr("bind", e))?;
    sock.connect(&SocketAddr::new(0, 0))
        .map_err(|e| nlerr("connect", e))?;
    sock.send(&buf, 0).map_err(|e| nlerr("send", e))?;
    let mut rbuf = vec![0u8; 8192];
    loop {
        let n = sock
            .recv(&mut &mut rbuf[..], 0)
            .map_err(|e| nlerr("recv", e))?;
        let mut off = 0;
        while off < n {
            let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rbuf[off..n])
                .map_err(|e| Error::Netlink(format!("bad reply: {e}")))?;
            let len = reply.header.length as usize;
            match reply.payload {
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        None => Ok(()),
                        Some(_) => Err(Error::Netlink(e.to_io().to_string())),
                    };
                }
                NetlinkPayload::Done(_) => return Ok(()),
                _ => {}
            }
            if len == 0 {
                break;
            }
            off += len;
        }
    }
}

/// Adds (or replaces) `addr/32 dev ifindex` in the main table.
pub(crate) fn add_host_route(addr: Ipv4Addr, ifindex: u32) -> Result<()> {
    request(
        RouteNetlinkMessage::NewRoute(message(addr, ifindex)),
        NLM_F_CREATE | NLM_F_REPLACE,
    )
}

/// Removes `addr/32 dev ifindex`; a route that is already gone is not an error.
pub(crate) fn del_host_route(addr: Ipv4Addr, ifindex: u32) -> Result<()> {
    match request(RouteNetlinkMessage::DelRoute(message(addr, ifindex)), 0) {
        Err(Error::Netlink(m)) if m.contains("No such process") || m.contains("not found") => {
            Ok(())
        }
        r => r,
    }
}

fn neigh_message(addr: Ipv4Addr, ifindex: u32, mac: [u8; 6]) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = AddressFamily::Inet;
    m.header.ifindex = ifindex;
    m.header.state = NeighbourState::Permanent;
    m.attributes
        .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
            addr,
        )));
    m.attributes
        .push(NeighbourAttribute::LinkLocalAddress(mac.to_vec()));
    m
}

/// Adds (or replaces) the permanent neighbour `addr lladdr mac dev ifindex`.
pub(crate) fn add_host_neigh(addr: Ipv4Addr, ifindex: u32, mac: [u8; 6]) -> Result<()> {
    request(
        RouteNetlinkMessage::NewNeighbour(neigh_message(addr, ifindex, mac)),
        NLM_F_CREATE | NLM_F_REPLACE,
    )
}

/// Removes the neighbour entry of `addr` on `ifindex`; one already gone is not an error.
pub(crate) fn del_host_neigh(addr: Ipv4Addr, ifindex: u32) -> Result<()> {
    match request(
        RouteNetlinkMessage::DelNeighbour(neigh_message(addr, ifindex, [0; 6])),
        0,
    ) {
        Err(Error::Netlink(m)) if m.contains("No such file") || m.contains("not found") => Ok(()),
        r => r,
    }
}
