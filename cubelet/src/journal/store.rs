//! A journal's book on disk, so a restarted node keeps its sandboxes' logs and metrics: one
//! append-only file per sandbox (`<data_dir>/journal/<id>.jsonl`). The first line is a header
//! (magic, version); every line is `<sha256 of the JSON, 16 hex> <JSON>`, so a torn tail (a
//! kill mid-write) or an edited line is detected, and what follows it is not trusted. The
//! sampler appends what changed each pass; a file that has grown past its bound is rewritten
//! from memory (temp file + rename).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use cube_proto::nodev1 as pb;

pub const MAGIC: &str = "cube-journal";
pub const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a journal of version {VERSION} ({why})")]
    Header { path: String, why: String },
}

#[derive(Serialize, Deserialize)]
struct Header {
    magic: String,
    version: u32,
}

/// One line's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum Record {
    /// The book's own state (the newest wins). The token is the sandbox's access token, which
    /// its agent wants for `/logs`; the directory is the node's own (0700).
    Meta {
        since_ms: u64,
        agent_next: u64,
        ended_ms: Option<u64>,
        token: Option<String>,
    },
    Sample(Sample),
    Entry(Entry),
}

/// `pb::SandboxStatsResponse` as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used_bytes: u64,
    pub mem_total_bytes: u64,
    pub mem_cache_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_total_bytes: u64,
    pub timestamp_ms: u64,
}

impl From<&pb::SandboxStatsResponse> for Sample {
    fn from(s: &pb::SandboxStatsResponse) -> Sample {
        Sample {
            cpu_count: s.cpu_count,
            cpu_used_pct: s.cpu_used_pct,
            mem_used_bytes: s.mem_used_bytes,
            mem_total_bytes: s.mem_total_bytes,
            mem_cache_bytes: s.mem_cache_bytes,
            disk_used_bytes: s.disk_used_bytes,
            disk_total_bytes: s.disk_total_bytes,
            timestamp_ms: s.timestamp_ms,
        }
    }
}

impl From<Sample> for pb::SandboxStatsResponse {
    fn from(s: Sample) -> pb::SandboxStatsResponse {
        pb::SandboxStatsResponse {
            cpu_count: s.cpu_count,
            cpu_used_pct: s.cpu_used_pct,
            mem_used_bytes: s.mem_used_bytes,
            mem_total_bytes: s.mem_total_bytes,
            mem_cache_bytes: s.mem_cache_bytes,
            disk_used_bytes: s.disk_used_bytes,
            disk_total_bytes: s.disk_total_bytes,
            timestamp_ms: s.timestamp_ms,
        }
    }
}

/// `pb::LogEntry` as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub timestamp_ms: u64,
    pub level: String,
    pub message: String,
    pub fields: BTreeMap<String, String>,
}

impl From<&pb::LogEntry> for Entry {
    fn from(e: &pb::LogEntry) -> Entry {
        Entry {
            timestamp_ms: e.timestamp_ms,
            level: e.level.clone(),
            message: e.message.clone(),
            fields: e
                .fields
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }
}

impl From<Entry> for pb::LogEntry {
    fn from(e: Entry) -> pb::LogEntry {
        pb::LogEntry {
            timestamp_ms: e.timestamp_ms,
            level: e.level,
            message: e.message,
            fields: e.fields.into_iter().collect(),
        }
    }
}

fn line(json: &str) -> String {
    let sum = crate::state::sha256_hex(json.as_bytes());
    format!("{} {json}\n", &sum[..16])
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn encode(records: &[Record]) -> String {
    let mut out = String::new();
    for r in records {
        // A record of plain strings and numbers always serializes.
        if let Ok(j) = serde_json::to_string(r) {
            out.push_str(&line(&j));
        }
    }
    out
}

/// Replaces the file with a header and `records`.
pub fn rewrite(path: &Path, records: &[Record]) -> Result<(), StoreError> {
    let header = serde_json::json!({"magic": MAGIC, "version": VERSION}).to_string();
    let body = line(&header) + &encode(records);
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, body).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Appends `records` to an existing file.
pub fn append(path: &Path, records: &[Record]) -> Result<(), StoreError> {
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(io(path))?;
    f.write_all(encode(records).as_bytes()).map_err(io(path))
}

/// What a file holds: its records up to the first bad line, and whether there was one (then
/// the caller rewrites it before appending again).
pub fn read(path: &Path) -> Result<(Vec<Record>, bool), StoreError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let mut lines = text.split_inclusive('\n');
    let bad_header = |why: &str| StoreError::Header {
        path: path.display().to_string(),
        why: why.to_string(),
    };
    let h = lines
        .next()
        .and_then(checked)
        .ok_or_else(|| bad_header("no valid header line"))?;
    let h: Header = serde_json::from_str(h).map_err(|e| bad_header(&e.to_string()))?;
    if h.magic != MAGIC || h.version != VERSION {
        return Err(bad_header(&format!("{} version {}", h.magic, h.version)));
    }
    let mut out = Vec::new();
    for l in lines {
        match checked(l).and_then(|j| serde_json::from_str::<Record>(j).ok()) {
            Some(r) => out.push(r),
            None => return Ok((out, true)),
        }
    }
    Ok((out, false))
}

/// The JSON of a whole, unaltered line.
fn checked(l: &str) -> Option<&str> {
    let l = l.strip_suffix('\n')?;
    let (sum, json) = l.split_once(' ')?;
    (sum.len() == 16 && crate::state::sha256_hex(json.as_bytes()).starts_with(sum)).then_some(json)
}
