//! Masquerade of sandbox traffic leaving the node and the redirect to the egress proxy, in an
//! nftables table of our own.
//!
//! This shells out to `nft -f -`: there is no maintained Rust nftables library that builds on
//! our toolchain, and one atomic `nft` transaction is exactly what we need (create-or-replace
//! the whole table in one step, idempotently).

use std::io::Write;
use std::net::SocketAddrV4;
use std::process::{Command, Stdio};

use crate::abi::PROXY_MARK;
use crate::config::Ipv4Cidr;
use crate::error::{Error, Result};

fn valid_name(table: &str) -> Result<()> {
    let ok = !table.is_empty()
        && table.len() <= 64
        && table
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        && table
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic());
    if ok {
        Ok(())
    } else {
        Err(Error::Nft(format!("invalid table name {table:?}")))
    }
}

fn run(script: &str) -> Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Nft(format!("cannot run nft: {e} (install nftables)")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| Error::Nft(format!("writing to nft: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::Nft(format!("waiting for nft: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Nft(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

/// Creates or replaces `table ip <table>`: the masquerade of traffic from the host pool to
/// anywhere outside it, and the DNAT of packets the datapath marked for the egress proxy (a
/// marked packet that would be forwarded instead is dropped: fail closed). The `add`+`delete`
/// prefix makes the transaction idempotent on nft versions without `destroy`.
pub(crate) fn install(
    table: &str,
    pool: Ipv4Cidr,
    masquerade: bool,
    proxy: Option<SocketAddrV4>,
) -> Result<()> {
    valid_name(table)?;
    let mut chains = String::new();
    if masquerade {
        chains.push_str(&format!(
            "chain postrouting {{\n\
               type nat hook postrouting priority srcnat; policy accept;\n\
               ip saddr {pool} ip daddr != {pool} masquerade\n\
             }}\n"
        ));
    }
    if let Some(proxy) = proxy {
        let mark = PROXY_MARK;
        chains.push_str(&format!(
            "chain prerouting {{\n\
               type nat hook prerouting priority dstnat; policy accept;\n\
               meta mark {mark:#x} ip saddr {pool} meta l4proto tcp dnat ip to {proxy}\n\
             }}\n\
             chain forward {{\n\
               type filter hook forward priority filter; policy accept;\n\
               meta mark {mark:#x} ip saddr {pool} drop\n\
             }}\n"
        ));
    }
    run(&format!(
        "add table ip {table}\n\
         delete table ip {table}\n\
         table ip {table} {{\n{chains}}}\n"
    ))
}

/// Removes our table; a missing table is not an error.
pub(crate) fn remove(table: &str) -> Result<()> {
    valid_name(table)?;
    run(&format!("add table ip {table}\ndelete table ip {table}\n"))
}

/// Whether our table exists (for tests and diagnostics).
pub fn table_exists(table: &str) -> bool {
    Command::new("nft")
        .args(["list", "table", "ip", table])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
