//! Bringing up `lo` and the guest interface with classic socket ioctls (no `ip` binary, no
//! netlink dependency): interface flags, IPv4 address/netmask, and the default route.

use crate::config::NetworkConfig;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `struct rtentry` from `<net/route.h>` (x86_64 layout).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

const SIOCADDRT: libc::c_ulong = 0x890B;
const RTF_UP: libc::c_ushort = 0x1;
const RTF_GATEWAY: libc::c_ushort = 0x2;

fn sockaddr_in(a: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.octets()),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; this is the classic cast.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// The netmask for a prefix length.
pub fn netmask(prefix: u8) -> Ipv4Addr {
    if prefix == 0 {
        Ipv4Addr::new(0, 0, 0, 0)
    } else {
        Ipv4Addr::from(u32::MAX << (32 - prefix.min(32) as u32))
    }
}

fn ifreq(name: &str) -> std::io::Result<libc::ifreq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    // SAFETY: ifreq is plain data; zero is a valid value.
    let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in name.bytes().enumerate() {
        r.ifr_name[i] = b as libc::c_char;
    }
    Ok(r)
}

fn ioctl(fd: &OwnedFd, req: libc::c_ulong, arg: *mut libc::c_void) -> std::io::Result<()> {
    // SAFETY: callers pass a pointer to the struct the request expects.
    if unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn socket() -> std::io::Result<OwnedFd> {
    // SAFETY: plain socket call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sets IFF_UP on an interface.
pub fn link_up(name: &str) -> std::io::Result<()> {
    let s = socket()?;
    let mut r = ifreq(name)?;
    ioctl(&s, libc::SIOCGIFFLAGS, (&mut r as *mut libc::ifreq).cast())?;
    // SAFETY: the union member written by SIOCGIFFLAGS.
    unsafe {
        r.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
    }
    ioctl(&s, libc::SIOCSIFFLAGS, (&mut r as *mut libc::ifreq).cast())
}

/// Assigns an IPv4 address and netmask.
pub fn set_address(name: &str, addr: Ipv4Addr, prefix: u8) -> std::io::Result<()> {
    let s = socket()?;
    let mut r = ifreq(name)?;
    r.ifr_ifru.ifru_addr = sockaddr_in(addr);
    ioctl(&s, libc::SIOCSIFADDR, (&mut r as *mut libc::ifreq).cast())?;
    let mut r = ifreq(name)?;
    r.ifr_ifru.ifru_netmask = sockaddr_in(netmask(prefix));
    ioctl(
        &s,
        libc::SIOCSIFNETMASK,
        (&mut r as *mut libc::ifreq).cast(),
    )
}

/// Adds `default via gw dev name`; an existing route is fine.
pub fn add_default_route(name: &str, gw: Ipv4Addr) -> std::io::Result<()> {
    let s = socket()?;
    let mut dev = std::ffi::CString::new(name)
        .map_err(|_| std::io::Error::other("NUL in interface name"))?
        .into_bytes_with_nul();
    let mut rt = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        rt_gateway: sockaddr_in(gw),
        rt_genmask: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        rt_flags: RTF_UP | RTF_GATEWAY,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: dev.as_mut_ptr().cast(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    match ioctl(&s, SIOCADDRT, (&mut rt as *mut RtEntry).cast()) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        r => r,
    }
}

/// Brings up `lo` and the configured interface. Logs and continues on any failure (an absent or
/// already configured interface is normal in some runtimes).
pub fn configure(cfg: &NetworkConfig) {
    if let Err(e) = link_up("lo") {
        tracing::warn!("bringing up lo failed: {e}");
    }
    let (addr, prefix) = match cfg.cidr() {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!("network config: {e}");
            return;
        }
    };
    let name = cfg.interface.as_str();
    if let Err(e) = set_address(name, addr, prefix) {
        tracing::warn!(
            interface = name,
            "setting address {addr}/{prefix} failed: {e}"
        );
    }
    if let Err(e) = link_up(name) {
        tracing::warn!(interface = name, "bringing the link up failed: {e}");
        return;
    }
    if let Err(e) = add_default_route(name, cfg.gateway) {
        tracing::warn!(
            interface = name,
            "adding default route via {} failed: {e}",
            cfg.gateway
        );
    } else {
        tracing::info!(
            interface = name,
            "network up: {addr}/{prefix} via {}",
            cfg.gateway
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netmasks() {
        assert_eq!(netmask(30), Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(netmask(0), Ipv4Addr::new(0, 0, 0, 0));
        assert_eq!(netmask(32), Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(std::mem::size_of::<RtEntry>(), 120);
    }

    #[test]
    fn bad_names_are_errors() {
        assert!(ifreq("").is_err());
        assert!(ifreq("this-name-is-way-too-long").is_err());
        assert!(link_up("nonexistent-if0").is_err());
    }
}
