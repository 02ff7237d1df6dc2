//! Each sandbox's history on its node, for E2B's metrics history and sandbox logs: the samples
//! the sampler took (`SandboxMetrics`), and a log of what happened to it — the node's lifecycle
//! events and its agent's process starts and exits, pulled from the agent's `GET /logs`
//! (`SandboxLogs`). Kept in memory, bounded per sandbox, for the sandbox's life and
//! `retention_s` after it ends (a node restart forgets it: it is a window, not an archive).

use cube_proto::nodev1 as pb;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

/// `[journal]` in cubelet.toml.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JournalConfig {
    /// How often each running sandbox is sampled and its agent's log pulled (E2B: 5 s).
    pub sample_interval_ms: u64,
    /// Samples kept per sandbox (the oldest go first): 720 at 5 s is an hour.
    pub max_samples: usize,
    /// Log entries kept per sandbox.
    pub max_entries: usize,
    /// How long a sandbox's history outlives it.
    pub retention_s: u64,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            sample_interval_ms: 5000,
            max_samples: 720,
            max_entries: 2000,
            retention_s: 3600,
        }
    }
}

/// Levels in order, lowest first (E2B's names).
pub const LEVELS: [&str; 4] = ["debug", "info", "warn", "error"];

fn rank(level: &str) -> Option<usize> {
    LEVELS.iter().position(|l| *l == level)
}

/// One entry as the agent's `GET /logs` gives it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentEntry {
    pub timestamp_ms: u64,
    pub level: String,
    pub message: String,
    #[serde(default)]
    pub fields: BTreeMap<String, String>,
}

/// The agent's `GET /logs` answer.
#[derive(Debug, Clone, Deserialize)]
pub struct AgentPage {
    pub next: u64,
    pub entries: Vec<AgentEntry>,
}

#[derive(Debug, Default)]
struct Book {
    samples: VecDeque<pb::SandboxStatsResponse>,
    entries: VecDeque<pb::LogEntry>,
    /// The agent's seq to pull from next.
    agent_next: u64,
    /// Agent entries older than this belong to the template's or the parent's life (a restored
    /// agent remembers them).
    since_ms: u64,
    /// The access token the agent wants (in memory only).
    token: Option<String>,
    ended_ms: Option<u64>,
}

/// Every sandbox's book.
#[derive(Debug, Default)]
pub struct Journal {
    cfg: JournalConfig,
    books: Mutex<HashMap<String, Book>>,
}

/// What to read of a log.
#[derive(Debug, Clone, Default)]
pub struct LogQuery {
    pub cursor_ms: u64,
    pub limit: usize,
    pub backward: bool,
    pub min_level: Option<usize>,
    pub search: String,
}

impl LogQuery {
    pub fn from_pb(r: &pb::SandboxLogsRequest) -> Result<LogQuery, String> {
        let min_level = match r.min_level.as_str() {
            "" => None,
            l => Some(rank(l).ok_or_else(|| {
                format!("unknown log level {l:?} (one of {})", LEVELS.join(", "))
            })?),
        };
        Ok(LogQuery {
            cursor_ms: r.cursor_ms,
            limit: match r.limit {
                0 => 1000,
                n => (n as usize).min(10_000),
            },
            backward: r.backward,
            min_level,
            search: r.search.clone(),
        })
    }

    fn matches(&self, e: &pb::LogEntry) -> bool {
        if let Some(min) = self.min_level {
            if rank(&e.level).is_none_or(|r| r < min) {
                return false;
            }
        }
        // E2B's search: a case-sensitive substring of the message.
        self.search.is_empty() || e.message.contains(&self.search)
    }
}

fn push_bounded<T>(q: &mut VecDeque<T>, v: T, cap: usize) {
    if q.len() >= cap.max(1) {
        q.pop_front();
    }
    q.push_back(v);
}

impl Journal {
    pub fn new(cfg: JournalConfig) -> Journal {
        Journal {
            cfg,
            books: Mutex::default(),
        }
    }

    pub fn config(&self) -> &JournalConfig {
        &self.cfg
    }

    fn with<R>(&self, id: &str, f: impl FnOnce(&mut Book) -> R) -> R {
        let mut m = self.books.lock().unwrap_or_else(|p| p.into_inner());
        f(m.entry(id.to_string()).or_default())
    }

    /// A sandbox begins (a create, or a node restart finding it): a reused id starts afresh.
    pub fn begin(&self, id: &str, since_ms: u64, token: Option<String>) {
        let mut m = self.books.lock().unwrap_or_else(|p| p.into_inner());
        let b = m.entry(id.to_string()).or_default();
        if b.ended_ms.is_some() {
            *b = Book::default();
        }
        b.since_ms = since_ms;
        if token.is_some() {
            b.token = token;
        }
    }

    pub fn token(&self, id: &str) -> Option<String> {
        self.books
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .and_then(|b| b.token.clone())
    }

    /// Where to pull the agent's log from.
    pub fn agent_next(&self, id: &str) -> u64 {
        self.with(id, |b| b.agent_next)
    }

    /// A lifecycle event from the node.
    pub fn event(&self, id: &str, level: &str, message: &str, fields: &[(&str, &str)]) {
        let cap = self.cfg.max_entries;
        let e = pb::LogEntry {
            timestamp_ms: crate::template::now_ms(),
            level: level.to_string(),
            message: message.to_string(),
            fields: std::iter::once(("logger".to_string(), "node".to_string()))
                .chain(fields.iter().map(|(k, v)| (k.to_string(), v.to_string())))
                .collect(),
        };
        self.with(id, |b| push_bounded(&mut b.entries, e, cap));
    }

    /// What the agent gave since the last pull. Entries are kept in time order: the agent's
    /// clock is the node's (it is set at init), and an entry stamped earlier than the newest
    /// one kept is placed by its time.
    pub fn ingest(&self, id: &str, page: AgentPage) {
        let cap = self.cfg.max_entries;
        self.with(id, |b| {
            b.agent_next = b.agent_next.max(page.next);
            for a in page.entries {
                if a.timestamp_ms < b.since_ms || rank(&a.level).is_none() {
                    continue;
                }
                let e = pb::LogEntry {
                    timestamp_ms: a.timestamp_ms,
                    level: a.level,
                    message: a.message,
                    fields: a.fields.into_iter().collect(),
                };
                let at = b
                    .entries
                    .partition_point(|x| x.timestamp_ms <= e.timestamp_ms);
                if b.entries.len() >= cap.max(1) {
                    if at == 0 {
                        continue;
                    }
                    b.entries.pop_front();
                    b.entries.insert(at - 1, e);
                } else {
                    b.entries.insert(at, e);
                }
            }
        });
    }

    pub fn sample(&self, id: &str, s: pb::SandboxStatsResponse) {
        let cap = self.cfg.max_samples;
        self.with(id, |b| push_bounded(&mut b.samples, s, cap));
    }

    /// The sandbox is gone; its book stays for the retention.
    pub fn end(&self, id: &str, now_ms: u64) {
        if let Some(b) = self
            .books
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(id)
        {
            b.ended_ms = Some(now_ms);
            b.token = None;
        }
    }

    /// Forgets books whose sandbox ended more than the retention ago.
    pub fn prune(&self, now_ms: u64) {
        let keep = self.cfg.retention_s.saturating_mul(1000);
        self.books
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, b| b.ended_ms.is_none_or(|t| now_ms.saturating_sub(t) <= keep));
    }

    /// Whether the node knows this sandbox's history (live or retained).
    pub fn knows(&self, id: &str) -> bool {
        self.books
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(id)
    }

    /// When the newest sample was taken (0: none yet).
    pub fn newest_sample_ms(&self, id: &str) -> u64 {
        let m = self.books.lock().unwrap_or_else(|p| p.into_inner());
        m.get(id)
            .and_then(|b| b.samples.back())
            .map(|s| s.timestamp_ms)
            .unwrap_or(0)
    }

    /// Samples with `start_ms <= t <= end_ms` (0 = unbounded), oldest first.
    pub fn samples(&self, id: &str, start_ms: u64, end_ms: u64) -> Vec<pb::SandboxStatsResponse> {
        let m = self.books.lock().unwrap_or_else(|p| p.into_inner());
        m.get(id)
            .map(|b| {
                b.samples
                    .iter()
                    .filter(|s| {
                        s.timestamp_ms >= start_ms && (end_ms == 0 || s.timestamp_ms <= end_ms)
                    })
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn logs(&self, id: &str, q: &LogQuery) -> Vec<pb::LogEntry> {
        let m = self.books.lock().unwrap_or_else(|p| p.into_inner());
        let Some(b) = m.get(id) else {
            return vec![];
        };
        let hit = |e: &&pb::LogEntry| q.matches(e);
        if q.backward {
            let up_to = if q.cursor_ms == 0 {
                u64::MAX
            } else {
                q.cursor_ms
            };
            b.entries
                .iter()
                .rev()
                .filter(|e| e.timestamp_ms <= up_to)
                .filter(hit)
                .take(q.limit)
                .cloned()
                .collect()
        } else {
            b.entries
                .iter()
                .filter(|e| e.timestamp_ms >= q.cursor_ms)
                .filter(hit)
                .take(q.limit)
                .cloned()
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(ts: u64, level: &str, msg: &str) -> AgentEntry {
        AgentEntry {
            timestamp_ms: ts,
            level: level.into(),
            message: msg.into(),
            fields: [("pid".to_string(), "7".to_string())].into(),
        }
    }

    fn q(cursor_ms: u64, backward: bool, level: &str, search: &str) -> LogQuery {
        LogQuery::from_pb(&pb::SandboxLogsRequest {
            sandbox_id: "s".into(),
            cursor_ms,
            limit: 0,
            backward,
            min_level: level.into(),
            search: search.into(),
        })
        .unwrap()
    }

    #[test]
    fn logs_filter_page_and_order() {
        let j = Journal::new(JournalConfig::default());
        j.begin("s", 100, None);
        j.ingest(
            "s",
            AgentPage {
                next: 4,
                entries: vec![
                    agent(50, "info", "from the template's life"),
                    agent(200, "info", "Process started"),
                    agent(300, "warn", "Process exited"),
                    agent(250, "bogus", "unknown level"),
                ],
            },
        );
        assert_eq!(j.agent_next("s"), 4);
        // An entry stamped between the two lands between them.
        j.ingest(
            "s",
            AgentPage {
                next: 5,
                entries: vec![agent(260, "error", "in between")],
            },
        );
        let all = j.logs("s", &q(0, false, "", ""));
        let msgs: Vec<&str> = all.iter().map(|e| e.message.as_str()).collect();
        assert_eq!(msgs, ["Process started", "in between", "Process exited"]);
        let back = j.logs("s", &q(0, true, "", ""));
        assert_eq!(back[0].message, "Process exited");
        assert_eq!(j.logs("s", &q(270, true, "", "")).len(), 2);
        assert_eq!(j.logs("s", &q(260, false, "", "")).len(), 2);
        assert_eq!(j.logs("s", &q(0, false, "warn", "")).len(), 2);
        assert_eq!(j.logs("s", &q(0, false, "", "started")).len(), 1);
        assert!(
            j.logs("s", &q(0, false, "", "STARTED")).is_empty(),
            "case-sensitive"
        );
        assert!(
            j.logs("s", &q(0, false, "", "7")).is_empty(),
            "fields are not searched"
        );
        assert!(LogQuery::from_pb(&pb::SandboxLogsRequest {
            min_level: "loud".into(),
            ..Default::default()
        })
        .is_err());
    }

    #[test]
    fn bounded_retained_then_forgotten() {
        let j = Journal::new(JournalConfig {
            max_samples: 3,
            max_entries: 2,
            retention_s: 10,
            ..Default::default()
        });
        j.begin("s", 0, Some("tok".into()));
        for t in 1..=5 {
            j.sample(
                "s",
                pb::SandboxStatsResponse {
                    timestamp_ms: t * 1000,
                    ..Default::default()
                },
            );
            j.event("s", "info", "e", &[]);
        }
        let ts: Vec<u64> = j
            .samples("s", 0, 0)
            .iter()
            .map(|s| s.timestamp_ms)
            .collect();
        assert_eq!(ts, [3000, 4000, 5000]);
        assert_eq!(j.newest_sample_ms("s"), 5000);
        assert_eq!(j.newest_sample_ms("none"), 0);
        assert_eq!(j.samples("s", 3500, 4500).len(), 1);
        assert_eq!(j.logs("s", &q(0, false, "", "")).len(), 2);
        assert_eq!(j.token("s").as_deref(), Some("tok"));
        j.end("s", 100_000);
        assert_eq!(j.token("s"), None);
        j.prune(105_000);
        assert!(j.knows("s"), "within the retention");
        j.prune(111_000);
        assert!(!j.knows("s"));
        // A reused id after the end starts afresh.
        j.begin("r", 0, None);
        j.event("r", "info", "old", &[]);
        j.end("r", 1);
        j.begin("r", 0, None);
        assert!(j.logs("r", &q(0, false, "", "")).is_empty());
    }
}
