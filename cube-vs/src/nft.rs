//! Masquerade of sandbox traffic leaving the node, in an nftables table of our own.
//!
//! This shells out to `nft -f -`: there is no maintained Rust nftables library that builds on
//! our toolchain, and one atomic `nft` transaction is exactly what we need (create-or-replace
//! the whole table in one step, idempotently).

use std::io::Write;
use std::process::{Command, Stdio};

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

/// Creates or replaces `table ip <table>` masquerading traffic from the host pool to anywhere
/// outside it. The `add`+`delete` prefix makes the transaction idempotent on nft versions
/// without `destroy`.
pub(crate) fn install(table: &str, pool: Ipv4Cidr) -> Result<()> {
    valid_name(table)?;
    run(&format!(
        "add table ip {table}\n\
         delete table ip {table}\n\
         table ip {table} {{\n\
           chain postrouting {{\n\
             type nat hook postrouting priority srcnat; policy accept;\n\
             ip saddr {pool} ip daddr != {pool} masquerade\n\
           }}\n\
         }}\n"
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
