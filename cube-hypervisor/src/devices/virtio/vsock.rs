//! Userspace virtio-vsock (stream sockets only) with a unix-socket host side, following
//! Firecracker's conventions:
//!
//! * host → guest: a host process connects to `uds_path`, writes `CONNECT <port>\n`; when the
//!   guest accepts, it reads `OK <host port>\n` and then talks to the guest's port `<port>`.
//! * guest → host: a guest connection to (CID 2, port P) becomes a connection to the unix
//!   socket `<uds_path>_P`.
//!
//! Flow control is virtio-vsock credit: the guest never sends more than our advertised
//! `buf_alloc` beyond what we forwarded (`fwd_cnt`), and we never send the guest more than its
//! advertised credit. Connections do not survive a snapshot: on restore the device sends
//! `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`, which makes the guest drop them (its listeners stay).
//!
//! Guest packets (queue 1) are handled on the notifying vCPU thread; host input (new
//! connections, stream data) reaches the guest through `process_backend()`.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::chain::ChainCursor;
use super::{read_config_bytes, DeviceError, QueueCtx, VirtioDevice, VIRTIO_F_VERSION_1};

/// Virtio device id of vsock.
pub const VIRTIO_ID_VSOCK: u32 = 19;
/// The host's CID.
pub const HOST_CID: u64 = 2;
/// Size of `struct virtio_vsock_hdr`.
pub const HDR_LEN: usize = 44;
const RX_QUEUE: u16 = 0;
const TX_QUEUE: u16 = 1;
const EVT_QUEUE: u16 = 2;
const QUEUE_SIZE: u16 = 256;
/// Receive buffer we advertise per connection (bytes the guest may have in flight to us).
pub const CONN_BUF: u32 = 256 * 1024;
/// Largest payload in one packet either way.
const MAX_PKT: usize = 64 * 1024;
/// Host ports handed to host-initiated connections start here (FC uses the same idea).
const FIRST_HOST_PORT: u32 = 1 << 30;
const MAX_HANDSHAKE_LINE: usize = 32;
const MAX_CONNS: usize = 1024;
/// Most control packets (RST, RESPONSE, CREDIT_UPDATE, ...) waiting for an rx buffer. Every guest
/// packet can provoke one, so a guest that sends without ever draining its rx queue would grow
/// the queue without bound; past this, new ones are dropped (counted, logged). Room for a few
/// per live connection, so a guest that does drain never hits it.
pub const MAX_RX_CTRL: usize = 4 * MAX_CONNS;
const BATCH: usize = 256;

const TYPE_STREAM: u16 = 1;
/// Packet operations.
pub mod op {
    /// Connection request.
    pub const REQUEST: u16 = 1;
    /// Connection accepted.
    pub const RESPONSE: u16 = 2;
    /// Connection reset / refused.
    pub const RST: u16 = 3;
    /// Half or full shutdown (flags).
    pub const SHUTDOWN: u16 = 4;
    /// Data.
    pub const RW: u16 = 5;
    /// Credit announcement.
    pub const CREDIT_UPDATE: u16 = 6;
    /// Ask the peer for a credit announcement.
    pub const CREDIT_REQUEST: u16 = 7;
}
/// SHUTDOWN flag: the sender will receive no more.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more.
pub const SHUTDOWN_SEND: u32 = 2;

/// `struct virtio_vsock_hdr`, decoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketHeader {
    /// Source CID.
    pub src_cid: u64,
    /// Destination CID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type (1 = stream).
    pub type_: u16,
    /// Operation ([`op`]).
    pub op: u16,
    /// Operation flags.
    pub flags: u32,
    /// Sender's receive buffer size.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer.
    pub fwd_cnt: u32,
}

impl PacketHeader {
    /// Little-endian wire form.
    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// Parses the wire form.
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or_default());
        PacketHeader {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }
}

/// Saved vsock state. Connections are not saved (see module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    /// Guest CID.
    pub guest_cid: u64,
    /// Host socket path at snapshot time (informational; restore takes a new one).
    pub uds_path: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// Host-initiated, REQUEST sent, waiting for the guest's RESPONSE.
    Connecting,
    Established,
}

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    state: ConnState,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    tx_cnt: u32,
    /// Bytes forwarded from the guest to the host stream.
    fwd_cnt: u32,
    last_fwd_cnt_sent: u32,
    /// Guest data the host stream has not taken yet (bounded by `CONN_BUF` via credit).
    to_host: VecDeque<u8>,
    host_eof: bool,
    guest_shut_send: bool,
}

impl Conn {
    fn new(stream: UnixStream, state: ConnState) -> Self {
        Conn {
            stream,
            state,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            tx_cnt: 0,
            fwd_cnt: 0,
            last_fwd_cnt_sent: 0,
            to_host: VecDeque::new(),
            host_eof: false,
            guest_shut_send: false,
        }
    }

    fn peer_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        // A peer claiming to have consumed more than we sent gets no credit, not a wrap.
        self.peer_buf_alloc
            .saturating_sub(in_flight)
            .min(self.peer_buf_alloc)
    }

    /// Writes buffered guest data to the host stream; returns false when the stream is dead.
    fn flush_to_host(&mut self) -> bool {
        while !self.to_host.is_empty() {
            let (a, _) = self.to_host.as_slices();
            match self.stream.write(a) {
                Ok(0) => return false,
                Ok(n) => {
                    self.to_host.drain(..n);
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(n as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
        if self.to_host.is_empty() && self.guest_shut_send {
            let _ = self.stream.shutdown(Shutdown::Write);
        }
        true
    }
}

/// A host connection that has not finished its `CONNECT <port>\n` line.
#[derive(Debug)]
struct Handshake {
    stream: UnixStream,
    line: Vec<u8>,
}

/// (host port, guest port)
type Key = (u32, u32);

/// virtio-vsock device.
#[derive(Debug)]
pub struct Vsock {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    handshakes: Vec<Handshake>,
    conns: HashMap<Key, Conn>,
    /// Control packets waiting for an rx buffer (at most [`MAX_RX_CTRL`]).
    rx_ctrl: VecDeque<PacketHeader>,
    /// Control packets dropped because `rx_ctrl` was full.
    ctrl_dropped: u64,
    next_host_port: u32,
    transport_reset_pending: bool,
    rx_starved: bool,
    queue_sizes: [u16; 3],
}

fn bind(path: &Path) -> io::Result<UnixListener> {
    // A stale socket file from a previous run of this VM is ours to replace; anything else is not.
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if md.file_type().is_socket() {
            std::fs::remove_file(path)?;
        }
    }
    let l = UnixListener::bind(path)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Connects without ever blocking the vCPU thread: a listener with a full backlog (or none)
/// refuses the guest's connection instead of stalling it.
fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; zeroed is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket(2) call.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: addr is a valid sockaddr_un and the length matches its type.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r != 0 {
        // EAGAIN here means the listener's backlog is full: refuse rather than wait.
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(fd))
}

impl Vsock {
    /// A device for guest CID `guest_cid` listening for host connections on `uds_path`.
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, DeviceError> {
        if guest_cid <= HOST_CID || guest_cid > u64::from(u32::MAX) {
            return Err(DeviceError::InvalidState(format!(
                "invalid guest CID {guest_cid}"
            )));
        }
        Ok(Vsock {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            listener: bind(uds_path)?,
            handshakes: Vec::new(),
            conns: HashMap::new(),
            rx_ctrl: VecDeque::new(),
            ctrl_dropped: 0,
            next_host_port: FIRST_HOST_PORT,
            transport_reset_pending: false,
            rx_starved: false,
            queue_sizes: [QUEUE_SIZE; 3],
        })
    }

    /// The guest's CID.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// Number of live connections (for tests and metrics).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Control packets dropped so far because the guest did not drain its rx queue.
    pub fn ctrl_dropped(&self) -> u64 {
        self.ctrl_dropped
    }

    /// Control packets waiting for an rx buffer.
    pub fn pending_ctrl(&self) -> usize {
        self.rx_ctrl.len()
    }

    fn ctrl_full(&self) -> bool {
        self.rx_ctrl.len() >= MAX_RX_CTRL
    }

    fn count_ctrl_drop(&mut self, what: &str) {
        self.ctrl_dropped += 1;
        // First drop and then every 1024th: a flooding guest must not flood the log too.
        if self.ctrl_dropped % 1024 == 1 {
            tracing::warn!(
                guest_cid = self.guest_cid,
                dropped = self.ctrl_dropped,
                what,
                "vsock: guest does not drain its rx queue; control queue full, dropping"
            );
        }
    }

    /// Queues a control packet for the guest; false (and counted) when the queue is full.
    fn push_ctrl(&mut self, h: PacketHeader) -> bool {
        if self.ctrl_full() {
            self.count_ctrl_drop("control packet");
            return false;
        }
        self.rx_ctrl.push_back(h);
        true
    }

    fn reply(&self, to: &PacketHeader, op: u16, flags: u32, fwd_cnt: u32) -> PacketHeader {
        PacketHeader {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: to.dst_port,
            dst_port: to.src_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF,
            fwd_cnt,
        }
    }

    fn to_guest(&self, key: Key, op: u16, flags: u32, fwd_cnt: u32) -> PacketHeader {
        PacketHeader {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: key.0,
            dst_port: key.1,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF,
            fwd_cnt,
        }
    }

    fn rst(&mut self, key: Key) {
        self.conns.remove(&key);
        let h = self.to_guest(key, op::RST, 0, 0);
        self.push_ctrl(h);
    }

    /// Handles one packet from the guest.
    fn handle_guest_packet(&mut self, hdr: PacketHeader, data: &[u8]) {
        if hdr.dst_cid != HOST_CID || hdr.src_cid != self.guest_cid {
            tracing::debug!(?hdr, "vsock: packet with foreign CIDs dropped");
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        if hdr.type_ != TYPE_STREAM {
            if hdr.op != op::RST {
                let r = self.reply(&hdr, op::RST, 0, 0);
                self.push_ctrl(r);
            }
            return;
        }
        if hdr.op == op::REQUEST {
            if self.ctrl_full() {
                // Neither a RESPONSE nor a RST could be queued: ignore the request (the guest
                // times out) rather than open a connection the guest never learns about.
                self.count_ctrl_drop("connection request");
                return;
            }
            if self.conns.contains_key(&key) || self.conns.len() >= MAX_CONNS {
                self.rst(key);
                return;
            }
            let path = format!("{}_{}", self.uds_path.display(), hdr.dst_port);
            match connect_nonblocking(Path::new(&path)) {
                Ok(stream) => {
                    let mut c = Conn::new(stream, ConnState::Established);
                    c.peer_buf_alloc = hdr.buf_alloc;
                    c.peer_fwd_cnt = hdr.fwd_cnt;
                    self.conns.insert(key, c);
                    let r = self.to_guest(key, op::RESPONSE, 0, 0);
                    self.push_ctrl(r);
                }
                Err(e) => {
                    tracing::debug!(%path, error = %e, "vsock: guest connect refused");
                    let r = self.reply(&hdr, op::RST, 0, 0);
                    self.push_ctrl(r);
                }
            }
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            if hdr.op != op::RST {
                let r = self.reply(&hdr, op::RST, 0, 0);
                self.push_ctrl(r);
            }
            return;
        };
        conn.peer_buf_alloc = hdr.buf_alloc;
        conn.peer_fwd_cnt = hdr.fwd_cnt;
        match hdr.op {
            op::RESPONSE if conn.state == ConnState::Connecting => {
                conn.state = ConnState::Established;
                let line = format!("OK {}\n", key.0);
                // The stream is fresh: a short line fits the socket buffer.
                if conn.stream.write_all(line.as_bytes()).is_err() {
                    self.rst(key);
                }
            }
            op::RW if conn.state == ConnState::Established => {
                if conn.to_host.len() + data.len() > CONN_BUF as usize {
                    // The guest ignored our credit.
                    tracing::debug!(?key, "vsock: guest exceeded credit");
                    self.rst(key);
                    return;
                }
                conn.to_host.extend(data);
                if !conn.flush_to_host() {
                    self.rst(key);
                }
            }
            op::CREDIT_UPDATE => {}
            op::CREDIT_REQUEST => {
                let fwd = conn.fwd_cnt;
                conn.last_fwd_cnt_sent = fwd;
                let r = self.to_guest(key, op::CREDIT_UPDATE, 0, fwd);
                self.push_ctrl(r);
            }
            op::SHUTDOWN => {
                if hdr.flags & SHUTDOWN_SEND != 0 {
                    conn.guest_shut_send = true;
                    if !conn.flush_to_host() {
                        self.rst(key);
                        return;
                    }
                }
                if hdr.flags & (SHUTDOWN_SEND | SHUTDOWN_RCV) == SHUTDOWN_SEND | SHUTDOWN_RCV {
                    // Full shutdown: acknowledge with RST and forget the connection.
                    self.rst(key);
                }
            }
            op::RST => {
                self.conns.remove(&key);
            }
            _ => self.rst(key),
        }
    }

    fn process_tx(&mut self, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        let mut data = vec![0u8; MAX_PKT];
        while let Some((head, parsed)) = ctx.pop(TX_QUEUE)? {
            if let Ok(chain) = parsed {
                let mut cur = ChainCursor::new(&chain.readable);
                let mut hb = [0u8; HDR_LEN];
                if let Ok(HDR_LEN) = cur.read(ctx.mem, &mut hb) {
                    let hdr = PacketHeader::from_bytes(&hb);
                    let want = (hdr.len as usize).min(MAX_PKT);
                    match cur.read(ctx.mem, &mut data[..want]) {
                        Ok(n) if n == hdr.len as usize => self.handle_guest_packet(hdr, &data[..n]),
                        _ => tracing::debug!(?hdr, "vsock: packet length mismatch, dropped"),
                    }
                }
            }
            ctx.add_used(TX_QUEUE, head, 0)?;
        }
        // Forwarding made room: announce credit once a quarter of the buffer was consumed.
        let mut updates = Vec::new();
        for (key, c) in self.conns.iter_mut() {
            if c.state == ConnState::Established
                && c.fwd_cnt.wrapping_sub(c.last_fwd_cnt_sent) >= CONN_BUF / 4
            {
                c.last_fwd_cnt_sent = c.fwd_cnt;
                updates.push((*key, c.fwd_cnt));
            }
        }
        for (key, fwd) in updates {
            let h = self.to_guest(key, op::CREDIT_UPDATE, 0, fwd);
            self.push_ctrl(h);
        }
        Ok(())
    }

    fn accept_host(&mut self) {
        while let Ok((s, _)) = self.listener.accept() {
            if s.set_nonblocking(true).is_ok() && self.handshakes.len() < MAX_CONNS {
                self.handshakes.push(Handshake {
                    stream: s,
                    line: Vec::new(),
                });
            }
        }
        let mut i = 0;
        while i < self.handshakes.len() {
            let mut byte = [0u8; 1];
            // Byte by byte so nothing after the newline (early payload) is swallowed.
            let outcome = loop {
                match self.handshakes[i].stream.read(&mut byte) {
                    Ok(0) => break Some(None),
                    Ok(_) if byte[0] == b'\n' => break Some(Some(())),
                    Ok(_) => {
                        let hs = &mut self.handshakes[i];
                        hs.line.push(byte[0]);
                        if hs.line.len() > MAX_HANDSHAKE_LINE {
                            break Some(None);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break Some(None),
                }
            };
            match outcome {
                None => i += 1,
                Some(None) => {
                    self.handshakes.swap_remove(i);
                }
                Some(Some(())) => {
                    let hs = self.handshakes.swap_remove(i);
                    let port = std::str::from_utf8(&hs.line)
                        .ok()
                        .and_then(|l| l.trim().strip_prefix("CONNECT "))
                        .and_then(|p| p.trim().parse::<u32>().ok());
                    let Some(guest_port) = port else {
                        tracing::debug!("vsock: bad handshake line");
                        continue;
                    };
                    if self.conns.len() >= MAX_CONNS {
                        continue;
                    }
                    if self.ctrl_full() {
                        // No room for the REQUEST: refuse (the host sees EOF) instead.
                        self.count_ctrl_drop("host connection");
                        continue;
                    }
                    let host_port = self.alloc_host_port(guest_port);
                    let key = (host_port, guest_port);
                    self.conns
                        .insert(key, Conn::new(hs.stream, ConnState::Connecting));
                    let h = self.to_guest(key, op::REQUEST, 0, 0);
                    self.push_ctrl(h);
                }
            }
        }
    }

    fn alloc_host_port(&mut self, guest_port: u32) -> u32 {
        loop {
            let p = self.next_host_port;
            self.next_host_port = self
                .next_host_port
                .checked_add(1)
                .unwrap_or(FIRST_HOST_PORT);
            if !self.conns.contains_key(&(p, guest_port)) {
                return p;
            }
        }
    }

    /// Reads host data for one connection into a packet; None when no connection has any.
    fn next_data_packet(&mut self, room: usize) -> Option<(PacketHeader, Vec<u8>)> {
        let keys: Vec<Key> = self.conns.keys().copied().collect();
        let mut dead = Vec::new();
        let mut out = None;
        for key in keys {
            let Some(c) = self.conns.get_mut(&key) else {
                continue;
            };
            if c.state != ConnState::Established || c.host_eof {
                continue;
            }
            let n = (c.peer_credit() as usize).min(room).min(MAX_PKT);
            if n == 0 {
                continue;
            }
            let mut buf = vec![0u8; n];
            match c.stream.read(&mut buf) {
                Ok(0) => {
                    c.host_eof = true;
                    dead.push(key);
                }
                Ok(got) => {
                    buf.truncate(got);
                    c.tx_cnt = c.tx_cnt.wrapping_add(got as u32);
                    c.last_fwd_cnt_sent = c.fwd_cnt;
                    let mut h = PacketHeader {
                        src_cid: HOST_CID,
                        dst_cid: self.guest_cid,
                        src_port: key.0,
                        dst_port: key.1,
                        len: got as u32,
                        type_: TYPE_STREAM,
                        op: op::RW,
                        flags: 0,
                        buf_alloc: CONN_BUF,
                        fwd_cnt: c.fwd_cnt,
                    };
                    h.len = got as u32;
                    out = Some((h, buf));
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => {
                    c.host_eof = true;
                    dead.push(key);
                }
            }
        }
        // The host closed: tell the guest it will get and take nothing more.
        for key in dead {
            let h = self.to_guest(key, op::SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND, 0);
            if !self.push_ctrl(h) {
                // The guest cannot be told: forget the connection rather than keep it around.
                self.conns.remove(&key);
            }
        }
        out
    }

    fn process_rx(&mut self, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        self.accept_host();
        for conn in self.conns.values_mut() {
            // Retry guest data the host stream was too full to take.
            let _ = conn.flush_to_host();
        }
        for _ in 0..BATCH {
            let Some((head, parsed)) = ctx.pop(RX_QUEUE)? else {
                // No buffers: stop polling connection data until the guest adds some.
                self.rx_starved = true;
                return Ok(());
            };
            let chain = match parsed {
                Ok(c) => c,
                Err(_) => {
                    ctx.add_used(RX_QUEUE, head, 0)?;
                    continue;
                }
            };
            let room = chain.writable_len().saturating_sub(HDR_LEN as u64) as usize;
            let pkt = match self.rx_ctrl.pop_front() {
                Some(h) => Some((h, Vec::new())),
                None => self
                    .next_data_packet(room)
                    .or_else(|| self.rx_ctrl.pop_front().map(|h| (h, Vec::new()))),
            };
            let Some((hdr, data)) = pkt else {
                ctx.undo_pop(RX_QUEUE)?;
                self.rx_starved = false;
                return Ok(());
            };
            if chain.writable_len() < (HDR_LEN + data.len()) as u64 {
                // Not even a header fits: the driver's buffers are unusable.
                ctx.add_used(RX_QUEUE, head, 0)?;
                continue;
            }
            let mut cur = ChainCursor::new(&chain.writable);
            let ok =
                cur.write(ctx.mem, &hdr.to_bytes()).is_ok() && cur.write(ctx.mem, &data).is_ok();
            let len = if ok { (HDR_LEN + data.len()) as u32 } else { 0 };
            ctx.add_used(RX_QUEUE, head, len)?;
        }
        Ok(())
    }

    fn deliver_events(&mut self, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        if !self.transport_reset_pending {
            return Ok(());
        }
        if let Some((head, parsed)) = ctx.pop(EVT_QUEUE)? {
            let mut len = 0;
            if let Ok(chain) = parsed {
                // struct virtio_vsock_event { le32 id }, id 0 = TRANSPORT_RESET.
                if matches!(
                    ChainCursor::new(&chain.writable).write(ctx.mem, &0u32.to_le_bytes()),
                    Ok(4)
                ) {
                    len = 4;
                    self.transport_reset_pending = false;
                }
            }
            ctx.add_used(EVT_QUEUE, head, len)?;
        }
        Ok(())
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.uds_path);
    }
}

impl VirtioDevice for Vsock {
    type State = VsockState;
    type Backend = PathBuf;

    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn device_features(&self) -> u64 {
        1u64 << VIRTIO_F_VERSION_1
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn reset(&mut self) {
        self.conns.clear();
        self.handshakes.clear();
        self.rx_ctrl.clear();
        self.transport_reset_pending = false;
        self.rx_starved = false;
    }

    fn queue_notify(&mut self, queue: u16, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        match queue {
            TX_QUEUE => {
                self.process_tx(ctx)?;
                self.process_rx(ctx)
            }
            RX_QUEUE => {
                self.rx_starved = false;
                self.process_rx(ctx)
            }
            EVT_QUEUE => self.deliver_events(ctx),
            _ => Ok(()),
        }
    }

    fn process_backend(&mut self, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        self.deliver_events(ctx)?;
        self.process_rx(ctx)
    }

    fn backend_fds(&self) -> Vec<RawFd> {
        let mut fds = vec![self.listener.as_raw_fd()];
        fds.extend(self.handshakes.iter().map(|h| h.stream.as_raw_fd()));
        if !self.rx_starved {
            fds.extend(
                self.conns
                    .values()
                    .filter(|c| {
                        c.state == ConnState::Established && !c.host_eof && c.peer_credit() > 0
                    })
                    .map(|c| c.stream.as_raw_fd()),
            );
        }
        fds
    }

    fn state(&self) -> VsockState {
        VsockState {
            guest_cid: self.guest_cid,
            uds_path: self.uds_path.clone(),
        }
    }

    fn restore(state: VsockState, uds_path: PathBuf) -> Result<Self, DeviceError> {
        Vsock::new(state.guest_cid, &uds_path)
    }

    fn restored(&mut self, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        // Connections were not carried over: tell the guest to drop its side of them.
        self.transport_reset_pending = true;
        self.deliver_events(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::irq::IrqLine;
    use crate::devices::virtio::testutil::*;
    use crate::devices::virtio::{MmioState, MmioTransport};
    use std::io::BufRead;
    use std::time::Duration;

    const CID: u64 = 3;
    const RXB: u32 = 4096;

    struct Env {
        _dir: tempfile::TempDir,
        path: PathBuf,
        t: MmioTransport<Vsock>,
        d: Driver,
        /// rx buffers posted: addr by head
        rx_bufs: HashMap<u32, u64>,
    }

    fn setup() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let mem = memory(8 << 20);
        let mut t = MmioTransport::new(
            Vsock::new(CID, &path).unwrap(),
            mem.clone(),
            IrqLine::new(8).unwrap(),
        )
        .unwrap();
        let mut d = Driver::new(mem);
        d.init(&mut t, 3, 64);
        let mut cfg = [0u8; 8];
        crate::devices::bus::BusDevice::read(&mut t, 0x100, &mut cfg);
        assert_eq!(u64::from_le_bytes(cfg), CID);
        Env {
            _dir: dir,
            path,
            t,
            d,
            rx_bufs: HashMap::new(),
        }
    }

    impl Env {
        fn post_rx(&mut self, n: usize) {
            for _ in 0..n {
                let a = self.d.alloc(u64::from(RXB));
                let h = self.d.add_chain(RX_QUEUE, &[(a, RXB, true)]);
                self.rx_bufs.insert(u32::from(h), a);
            }
        }

        fn take_rx(&mut self) -> Vec<(PacketHeader, Vec<u8>)> {
            self.d
                .take_used(RX_QUEUE)
                .into_iter()
                .map(|(id, len)| {
                    let a = self.rx_bufs[&id];
                    let raw = self.d.read(a, len as usize);
                    let h = PacketHeader::from_bytes(raw[..HDR_LEN].try_into().unwrap());
                    assert_eq!(h.len as usize, raw.len() - HDR_LEN);
                    (h, raw[HDR_LEN..].to_vec())
                })
                .collect()
        }

        fn guest_send(&mut self, h: PacketHeader, data: &[u8]) {
            let mut h = h;
            h.len = data.len() as u32;
            let a = self.d.alloc(HDR_LEN as u64);
            self.d.write(a, &h.to_bytes());
            if data.is_empty() {
                self.d.add_chain(TX_QUEUE, &[(a, HDR_LEN as u32, false)]);
            } else {
                let b = self.d.alloc(data.len() as u64);
                self.d.write(b, data);
                self.d.add_chain(
                    TX_QUEUE,
                    &[(a, HDR_LEN as u32, false), (b, data.len() as u32, false)],
                );
            }
            self.d.notify(&mut self.t, TX_QUEUE);
            assert!(!self.d.take_used(TX_QUEUE).is_empty());
        }

        /// Polls the backend until `n` rx packets arrived (bounded wait).
        fn wait_rx(&mut self, n: usize) -> Vec<(PacketHeader, Vec<u8>)> {
            let mut got = Vec::new();
            for _ in 0..200 {
                self.t.process_backend();
                got.extend(self.take_rx());
                if got.len() >= n {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            got
        }
    }

    fn g(src_port: u32, dst_port: u32, op: u16, buf_alloc: u32, fwd_cnt: u32) -> PacketHeader {
        PacketHeader {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc,
            fwd_cnt,
        }
    }

    #[test]
    fn host_initiated_connection_data_and_shutdown() {
        let mut e = setup();
        e.post_rx(8);
        let mut host = UnixStream::connect(&e.path).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(b"CONNECT 1234\n").unwrap();
        let p = e.wait_rx(1);
        assert_eq!(p.len(), 1);
        let req = p[0].0;
        assert_eq!(
            (req.op, req.src_cid, req.dst_cid, req.dst_port),
            (op::REQUEST, HOST_CID, CID, 1234)
        );
        assert!(req.src_port >= FIRST_HOST_PORT);
        let hp = req.src_port;

        e.guest_send(g(1234, hp, op::RESPONSE, 65536, 0), &[]);
        let mut line = String::new();
        std::io::BufReader::new(host.try_clone().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, format!("OK {hp}\n"));

        host.write_all(b"hello guest").unwrap();
        let p = e.wait_rx(1);
        assert_eq!(p[0].0.op, op::RW);
        assert_eq!((p[0].0.src_port, p[0].0.dst_port), (hp, 1234));
        assert_eq!(p[0].1, b"hello guest");

        e.guest_send(g(1234, hp, op::RW, 65536, 11), b"hello host");
        let mut buf = [0u8; 10];
        host.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hello host");

        // Guest closes both directions: host sees EOF, guest gets RST, connection is gone.
        let mut sh = g(1234, hp, op::SHUTDOWN, 65536, 11);
        sh.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
        e.guest_send(sh, &[]);
        let p = e.take_rx();
        assert_eq!(p.last().unwrap().0.op, op::RST);
        assert_eq!(host.read(&mut buf).unwrap(), 0);
        assert_eq!(e.t.device().connection_count(), 0);

        // Malformed handshakes are dropped without disturbing the device.
        let mut bad = UnixStream::connect(&e.path).unwrap();
        bad.write_all(b"CONNECT nope\n").unwrap();
        let mut bad2 = UnixStream::connect(&e.path).unwrap();
        bad2.write_all(&[b'A'; 100]).unwrap();
        bad.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        bad2.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        e.wait_rx(0);
        for _ in 0..20 {
            e.t.process_backend();
        }
        assert_eq!(bad.read(&mut buf).unwrap_or(0), 0);
        assert_eq!(bad2.read(&mut buf).unwrap_or(0), 0);
        assert!(e.take_rx().is_empty());
        assert!(!e.t.needs_reset());
    }

    #[test]
    fn guest_initiated_connection_and_credit() {
        let mut e = setup();
        let lpath = format!("{}_5000", e.path.display());
        let listener = UnixListener::bind(&lpath).unwrap();
        e.post_rx(16);
        // Refused port: RST.
        e.guest_send(g(77, 5001, op::REQUEST, 10, 0), &[]);
        let p = e.take_rx();
        assert_eq!(
            (p[0].0.op, p[0].0.dst_port, p[0].0.src_port),
            (op::RST, 77, 5001)
        );

        // Accepted, with a tiny guest receive buffer of 10 bytes.
        e.guest_send(g(77, 5000, op::REQUEST, 10, 0), &[]);
        let p = e.take_rx();
        assert_eq!(p[0].0.op, op::RESPONSE);
        let (mut host, _) = listener.accept().unwrap();
        host.write_all(&[b'x'; 25]).unwrap();
        let p = e.wait_rx(1);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].1.len(), 10, "no more than the guest's credit");
        for _ in 0..5 {
            e.t.process_backend();
        }
        assert!(e.take_rx().is_empty(), "credit exhausted");
        assert!(
            e.t.backend_fds().len() == 1,
            "credit-less connection is not polled"
        );
        e.guest_send(g(77, 5000, op::CREDIT_UPDATE, 10, 10), &[]);
        let p = e.wait_rx(1);
        assert_eq!(p[0].1.len(), 10);

        // Credit request is answered with our counters.
        e.guest_send(g(77, 5000, op::RW, 10, 20), b"abc");
        e.guest_send(g(77, 5000, op::CREDIT_REQUEST, 10, 20), &[]);
        let p = e.wait_rx(2);
        let cu = p
            .iter()
            .find(|(h, _)| h.op == op::CREDIT_UPDATE)
            .expect("credit update");
        assert_eq!((cu.0.buf_alloc, cu.0.fwd_cnt), (CONN_BUF, 3));
        let rw = p
            .iter()
            .find(|(h, _)| h.op == op::RW)
            .expect("remaining data");
        assert_eq!(rw.1.len(), 5);

        // Host closes: guest is told with a full SHUTDOWN.
        drop(host);
        let p = e.wait_rx(1);
        assert_eq!(p[0].0.op, op::SHUTDOWN);
        assert_eq!(p[0].0.flags, SHUTDOWN_RCV | SHUTDOWN_SEND);
        e.guest_send(g(77, 5000, op::RST, 10, 20), &[]);
        assert_eq!(e.t.device().connection_count(), 0);
        drop(listener);
        let _ = std::fs::remove_file(&lpath);
    }

    #[test]
    fn hostile_packets() {
        let mut e = setup();
        let lpath = format!("{}_6000", e.path.display());
        let listener = UnixListener::bind(&lpath).unwrap();
        e.post_rx(16);
        // Foreign source CID: silently dropped.
        let mut h = g(1, 6000, op::REQUEST, 100, 0);
        h.src_cid = 99;
        e.guest_send(h, &[]);
        // Datagram type: RST.
        let mut h = g(1, 6000, op::REQUEST, 100, 0);
        h.type_ = 2;
        e.guest_send(h, &[]);
        // Data for a connection that does not exist: RST.
        e.guest_send(g(2, 6000, op::RW, 100, 0), b"zz");
        // Unknown op on an existing connection: RST and the connection is dropped.
        e.guest_send(g(3, 6000, op::REQUEST, 100, 0), &[]);
        e.guest_send(g(3, 6000, 42, 100, 0), &[]);
        // Header claiming more data than the chain holds: dropped.
        let a = e.d.alloc(HDR_LEN as u64);
        let mut hh = g(4, 6000, op::REQUEST, 100, 0);
        hh.len = 0xffff_ffff;
        e.d.write(a, &hh.to_bytes());
        e.d.add_chain(TX_QUEUE, &[(a, HDR_LEN as u32, false)]);
        // A truncated header and an out-of-range buffer.
        e.d.add_chain(TX_QUEUE, &[(a, 10, false)]);
        e.d.add_chain(
            TX_QUEUE,
            &[(a, HDR_LEN as u32, false), (0xdead_0000_0000, 5, false)],
        );
        e.d.notify(&mut e.t, TX_QUEUE);
        assert_eq!(e.d.take_used(TX_QUEUE).len(), 3);
        // Guest exceeding our advertised credit: RST.
        e.guest_send(g(5, 6000, op::REQUEST, 100, 0), &[]);
        let (_h5a, _) = listener.accept().unwrap();
        let (_h3, _) = listener.accept().unwrap();
        let early: Vec<(u16, u32)> = e
            .take_rx()
            .iter()
            .map(|(h, _)| (h.op, h.dst_port))
            .collect();
        assert_eq!(
            early,
            vec![
                (op::RST, 1),
                (op::RST, 2),
                (op::RESPONSE, 3),
                (op::RST, 3),
                (op::RESPONSE, 5)
            ]
        );
        // The host side never reads, so the socket fills up and then our buffer does.
        let chunk = vec![7u8; MAX_PKT];
        let mut reset = false;
        for _ in 0..64 {
            e.post_rx(1);
            e.guest_send(g(5, 6000, op::RW, 100, 0), &chunk);
            if e.take_rx()
                .iter()
                .any(|(h, _)| h.op == op::RST && h.dst_port == 5)
            {
                reset = true;
                break;
            }
        }
        assert!(reset, "a guest ignoring our credit is reset");
        assert_eq!(e.t.device().connection_count(), 0);
        // rx buffers too small for a header are returned empty rather than overflowed.
        let tiny = e.d.alloc(8);
        e.d.add_chain(RX_QUEUE, &[(tiny, 8, true)]);
        e.guest_send(g(9, 7777, op::REQUEST, 100, 0), &[]);
        assert!(!e.t.needs_reset());
        drop(listener);
        let _ = std::fs::remove_file(&lpath);
    }

    #[test]
    fn a_guest_that_never_drains_rx_cannot_grow_the_control_queue() {
        let mut e = setup();
        let lpath = format!("{}_6100", e.path.display());
        let listener = UnixListener::bind(&lpath).unwrap();
        listener.set_nonblocking(true).unwrap();
        // No rx buffers posted: every reply the guest provokes stays queued.
        let extra = 300;
        for i in 0..(MAX_RX_CTRL + extra) as u32 {
            // Data for a connection that does not exist: each one asks for a RST.
            e.guest_send(g(10_000 + i, 6100, op::RW, 100, 0), b"z");
        }
        assert_eq!(e.t.device().pending_ctrl(), MAX_RX_CTRL);
        assert_eq!(e.t.device().ctrl_dropped(), extra as u64);
        // Credit requests and datagram-type packets are capped the same way.
        e.guest_send(g(1, 6100, op::CREDIT_REQUEST, 100, 0), &[]);
        let mut dgram = g(2, 6100, op::REQUEST, 100, 0);
        dgram.type_ = 2;
        e.guest_send(dgram, &[]);
        assert_eq!(e.t.device().pending_ctrl(), MAX_RX_CTRL);
        // While full, a connection request opens nothing (its RESPONSE could not be sent)...
        e.guest_send(g(3, 6100, op::REQUEST, 100, 0), &[]);
        assert_eq!(e.t.device().connection_count(), 0);
        assert!(listener.accept().is_err(), "no host connection was made");
        // ...and a host connection is refused (EOF) instead of queueing a REQUEST.
        let mut host = UnixStream::connect(&e.path).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(b"CONNECT 1234\n").unwrap();
        for _ in 0..20 {
            e.t.process_backend();
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut b = [0u8; 1];
        assert_eq!(host.read(&mut b).unwrap_or(0), 0, "host connection refused");
        assert_eq!(e.t.device().pending_ctrl(), MAX_RX_CTRL);
        assert_eq!(e.t.device().connection_count(), 0);
        let dropped = e.t.device().ctrl_dropped();
        assert_eq!(dropped, extra as u64 + 4);
        // Once the guest drains, the queued replies go out, oldest first, and the queue shrinks.
        e.post_rx(16);
        e.d.notify(&mut e.t, RX_QUEUE);
        let p = e.take_rx();
        assert_eq!(p.len(), 16);
        assert!(p.iter().all(|(h, _)| h.op == op::RST));
        assert_eq!(p[0].0.dst_port, 10_000);
        assert_eq!(e.t.device().pending_ctrl(), MAX_RX_CTRL - 16);
        assert!(!e.t.needs_reset());
        drop(listener);
        let _ = std::fs::remove_file(&lpath);
    }

    #[test]
    fn a_host_listener_with_a_full_backlog_refuses_instead_of_blocking() {
        let mut e = setup();
        let lpath = format!("{}_8000", e.path.display());
        let listener = UnixListener::bind(&lpath).unwrap();
        // SAFETY: re-listen on our own socket with the smallest backlog.
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
        // Fill the backlog with connections nobody accepts.
        let mut fillers = Vec::new();
        while let Ok(c) = connect_nonblocking(Path::new(&lpath)) {
            fillers.push(c);
            assert!(fillers.len() < 64, "backlog never filled");
        }
        assert!(
            connect_nonblocking(Path::new(&lpath)).is_err(),
            "backlog is full"
        );
        e.post_rx(2);
        let t0 = std::time::Instant::now();
        e.guest_send(g(11, 8000, op::REQUEST, 100, 0), &[]);
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "the vCPU thread was not blocked"
        );
        let p = e.take_rx();
        assert_eq!((p[0].0.op, p[0].0.dst_port), (op::RST, 11));
        drop(listener);
        let _ = std::fs::remove_file(&lpath);
    }

    #[test]
    fn snapshot_restore_resets_transport_and_listens_on_new_path() {
        let mut e = setup();
        let lpath = format!("{}_7000", e.path.display());
        let listener = UnixListener::bind(&lpath).unwrap();
        e.post_rx(8);
        e.guest_send(g(10, 7000, op::REQUEST, 100, 0), &[]);
        assert_eq!(e.take_rx()[0].0.op, op::RESPONSE);
        let (mut host, _) = listener.accept().unwrap();
        // Event buffer posted before the snapshot.
        let ev = e.d.alloc(4);
        e.d.write(ev, &[0xff; 4]);
        e.d.add_chain(EVT_QUEUE, &[(ev, 4, true)]);
        e.d.notify(&mut e.t, EVT_QUEUE);
        assert!(
            e.d.take_used(EVT_QUEUE).is_empty(),
            "no event before restore"
        );

        let st = e.t.state();
        let st: MmioState<VsockState> =
            serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
        assert_eq!(st.device.guest_cid, CID);
        let old = std::mem::replace(
            &mut e.t,
            MmioTransport::restore(
                st.clone(),
                e.path.with_file_name("v2.sock"),
                e.d.mem.clone(),
                IrqLine::new(8).unwrap(),
            )
            .unwrap(),
        );
        drop(old);
        assert!(!e.path.exists(), "old socket removed with the old device");
        assert_eq!(e.d.take_used(EVT_QUEUE), vec![(0, 4)]);
        assert_eq!(e.d.read(ev, 4), vec![0, 0, 0, 0], "TRANSPORT_RESET event");
        let mut b = [0u8; 1];
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(host.read(&mut b).unwrap(), 0, "old connections are closed");
        // The restored device serves host connections on its new path.
        let mut h2 = UnixStream::connect(e.path.with_file_name("v2.sock")).unwrap();
        h2.write_all(b"CONNECT 99\n").unwrap();
        let p = e.wait_rx(1);
        assert_eq!((p[0].0.op, p[0].0.dst_port), (op::REQUEST, 99));
        // A restore onto a path in a missing directory fails cleanly.
        assert!(MmioTransport::<Vsock>::restore(
            st,
            PathBuf::from("/nonexistent-dir-hvdev/x.sock"),
            e.d.mem.clone(),
            IrqLine::new(8).unwrap()
        )
        .is_err());
        drop(listener);
        let _ = std::fs::remove_file(&lpath);
    }
}
