//! What the agent tells its node about the sandbox's life, for E2B's sandbox logs: process
//! starts and exits, and what processes write to stdout and stderr (bounded per process). A bounded ring with a sequence number; the node pulls what is new with
//! `GET /logs?after=<seq>` and keeps it past the sandbox's end (the agent's copy dies with it).

use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

/// Entries kept when the node has not pulled for a while (the oldest go first).
pub const CAPACITY: usize = 1000;
/// Longest command line recorded (the rest is cut, on a character boundary).
const MAX_FIELD: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub seq: u64,
    pub timestamp_ms: u64,
    pub level: Level,
    pub message: String,
    pub fields: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
struct Ring {
    next: u64,
    entries: VecDeque<Entry>,
}

#[derive(Debug, Default)]
pub struct Journal {
    ring: Mutex<Ring>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `s` cut to the longest field the journal keeps (on a character boundary, marked `…`).
pub fn cut_text(s: &str) -> String {
    cut(s.to_string())
}

fn cut(mut s: String) -> String {
    if s.len() > MAX_FIELD {
        let mut end = MAX_FIELD;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

impl Journal {
    pub fn record(&self, level: Level, message: &str, fields: &[(&str, String)]) {
        let mut r = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let seq = r.next;
        r.next += 1;
        if r.entries.len() >= CAPACITY {
            r.entries.pop_front();
        }
        r.entries.push_back(Entry {
            seq,
            timestamp_ms: now_ms(),
            level,
            message: message.to_string(),
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_string(), cut(v.clone())))
                .collect(),
        });
    }

    /// Entries with `seq >= after`, oldest first, at most `limit`; and the seq to ask from next.
    pub fn since(&self, after: u64, limit: usize) -> (Vec<Entry>, u64) {
        let r = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let out: Vec<Entry> = r
            .entries
            .iter()
            .filter(|e| e.seq >= after)
            .take(limit)
            .cloned()
            .collect();
        let next = out.last().map(|e| e.seq + 1).unwrap_or(r.next.max(after));
        (out, next)
    }
}

/// A command line as one string (each argument quoted when it needs it), for the log.
pub fn command_line(cmd: &str, args: &[String]) -> String {
    let quote = |a: &str| {
        if !a.is_empty()
            && a.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
        {
            a.to_string()
        } else {
            format!("'{}'", a.replace('\'', r"'\''"))
        }
    };
    std::iter::once(cmd)
        .chain(args.iter().map(String::as_str))
        .map(quote)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_newest_and_resumes_from_a_seq() {
        let j = Journal::default();
        assert_eq!(j.since(0, 10).1, 0);
        for i in 0..(CAPACITY + 5) {
            j.record(Level::Info, "m", &[("i", i.to_string())]);
        }
        let (all, next) = j.since(0, usize::MAX);
        assert_eq!(all.len(), CAPACITY);
        assert_eq!(all[0].seq, 5, "the five oldest were dropped");
        assert_eq!(next, (CAPACITY + 5) as u64);
        let (some, next) = j.since(100, 3);
        assert_eq!(
            some.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [100, 101, 102]
        );
        assert_eq!(next, 103);
        // Asking past the end returns nothing and keeps the caller's position.
        let (none, next) = j.since(5000, 3);
        assert!(none.is_empty());
        assert_eq!(next, 5000);
    }

    #[test]
    fn long_fields_are_cut_and_commands_quoted() {
        let j = Journal::default();
        j.record(Level::Warn, "x", &[("cmd", "é".repeat(600))]);
        let e = &j.since(0, 1).0[0];
        assert!(e.fields["cmd"].len() <= MAX_FIELD + '…'.len_utf8());
        assert_eq!(
            command_line(
                "/bin/bash",
                &["-l".into(), "-c".into(), "echo 'hi' there".into()]
            ),
            r"/bin/bash -l -c 'echo '\''hi'\'' there'"
        );
        assert_eq!(
            serde_json::to_value(e).unwrap()["level"],
            serde_json::json!("warn")
        );
    }
}
