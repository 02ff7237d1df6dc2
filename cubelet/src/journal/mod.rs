//! Each sandbox's history on its node, for E2B's metrics history and sandbox logs: the samples
//! the sampler took (`SandboxMetrics`), and a log of what happened to it — the node's lifecycle
//! events and its agent's process starts and exits, pulled from the agent's `GET /logs`
//! (`SandboxLogs`). Kept in memory, bounded per sandbox, for the sandbox's life and
//! `retention_s` after it ends, and on disk (`store`) so that a restarted node keeps it: the
//! sampler appends each pass's changes ([`Journal::flush`]).

mod store;

use cube_proto::nodev1 as pb;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use store::Record;

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
    /// The access token the agent wants.
    token: Option<String>,
    ended_ms: Option<u64>,
    /// Records not yet on disk.
    pending: Vec<Record>,
    /// Records in the book's file.
    lines: usize,
    /// The file must be rewritten from memory (new, reset, torn, or too long).
    rewrite: bool,
}

impl Book {
    fn meta(&self) -> Record {
        Record::Meta {
            since_ms: self.since_ms,
            agent_next: self.agent_next,
            ended_ms: self.ended_ms,
            token: self.token.clone(),
        }
    }

    /// Everything the book holds, as records (what a rewrite writes).
    fn snapshot(&self) -> Vec<Record> {
        std::iter::once(self.meta())
            .chain(self.samples.iter().map(|s| Record::Sample(s.into())))
            .chain(self.entries.iter().map(|e| Record::Entry(e.into())))
            .collect()
    }

    fn insert_entry(&mut self, e: pb::LogEntry, cap: usize) -> bool {
        let at = self
            .entries
            .partition_point(|x| x.timestamp_ms <= e.timestamp_ms);
        if self.entries.len() >= cap.max(1) {
            if at == 0 {
                return false;
            }
            self.entries.pop_front();
            self.entries.insert(at - 1, e);
        } else {
            self.entries.insert(at, e);
        }
        true
    }
}

/// Every sandbox's book.
#[derive(Debug, Default)]
pub struct Journal {
    cfg: JournalConfig,
    books: Mutex<HashMap<String, Book>>,
    /// Where the books are kept on disk (`None`: memory only).
    dir: Option<PathBuf>,
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
    /// A journal in memory only.
    pub fn new(cfg: JournalConfig) -> Journal {
        Journal {
            cfg,
            books: Mutex::default(),
            dir: None,
        }
    }

    /// A journal kept in `dir` too, with what an earlier node left there. A file that cannot
    /// be read is set aside (renamed `.bad`), never trusted; a torn tail is dropped.
    pub fn open(cfg: JournalConfig, dir: &Path) -> std::io::Result<Journal> {
        std::fs::create_dir_all(dir)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        let mut books = HashMap::new();
        for ent in std::fs::read_dir(dir)?.flatten() {
            let path = ent.path();
            let Some(id) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".jsonl"))
                .map(str::to_string)
            else {
                continue;
            };
            match store::read(&path) {
                Ok((records, torn)) => {
                    let mut b = Book {
                        lines: records.len(),
                        rewrite: torn,
                        ..Book::default()
                    };
                    for r in records {
                        match r {
                            Record::Meta {
                                since_ms,
                                agent_next,
                                ended_ms,
                                token,
                            } => {
                                (b.since_ms, b.agent_next) = (since_ms, agent_next);
                                (b.ended_ms, b.token) = (ended_ms, token);
                            }
                            Record::Sample(s) => {
                                push_bounded(&mut b.samples, s.into(), cfg.max_samples)
                            }
                            Record::Entry(e) => {
                                b.insert_entry(e.into(), cfg.max_entries);
                            }
                        }
                    }
                    if torn {
                        tracing::warn!(path = %path.display(), "journal: torn tail dropped");
                    }
                    books.insert(id, b);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "journal: file set aside");
                    let _ = std::fs::rename(&path, path.with_extension("bad"));
                }
            }
        }
        Ok(Journal {
            cfg,
            books: Mutex::new(books),
            dir: Some(dir.to_path_buf()),
        })
    }

    fn file(&self, id: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{id}.jsonl")))
    }

    /// Writes what changed since the last flush: appended, or the whole book when its file
    /// is new, torn or past its bound. A failure is logged and retried at the next flush.
    pub fn flush(&self) {
        if self.dir.is_none() {
            return;
        }
        // Past this many lines a file is rewritten from memory (its content is bounded).
        let bound = 2 * (self.cfg.max_samples + self.cfg.max_entries) + 64;
        let work: Vec<(String, bool, Vec<Record>)> = {
            let mut m = self.books.lock().unwrap_or_else(|p| p.into_inner());
            m.iter_mut()
                .filter(|(_, b)| !b.pending.is_empty() || b.rewrite)
                .map(|(id, b)| {
                    let pending = std::mem::take(&mut b.pending);
                    if b.rewrite || b.lines + pending.len() > bound {
                        let all = b.snapshot();
                        b.lines = all.len();
                        b.rewrite = false;
                        (id.clone(), true, all)
                    } else {
                        b.lines += pending.len();
                        (id.clone(), false, pending)
                    }
                })
                .collect()
        };
        for (id, whole, records) in work {
            let Some(path) = self.file(&id) else { continue };
            let r = if whole || !path.exists() {
                store::rewrite(&path, &records)
            } else {
                store::append(&path, &records)
            };
            if let Err(e) = r {
                tracing::warn!(id = %id, error = %e, "journal: not saved");
                self.with(&id, |b| b.rewrite = true);
            }
        }
    }

    /// After a restart: books of sandboxes that are no longer here end now (they went while
    /// no node watched), so the retention applies to them.
    pub fn end_missing(&self, live: &HashSet<String>, now_ms: u64) {
        let ids: Vec<String> = {
            let m = self.books.lock().unwrap_or_else(|p| p.into_inner());
            m.iter()
                .filter(|(id, b)| b.ended_ms.is_none() && !live.contains(*id))
                .map(|(id, _)| id.clone())
                .collect()
        };
        for id in ids {
            self.end(&id, now_ms);
        }
    }

    fn persist(&self) -> bool {
        self.dir.is_some()
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
            *b = Book {
                rewrite: true,
                ..Book::default()
            };
        }
        b.since_ms = since_ms;
        if token.is_some() {
            b.token = token;
        }
        if self.persist() {
            let meta = b.meta();
            b.pending.push(meta);
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
        let persist = self.persist();
        self.with(id, |b| {
            if persist {
                b.pending.push(Record::Entry((&e).into()));
            }
            push_bounded(&mut b.entries, e, cap)
        });
    }

    /// What the agent gave since the last pull. Entries are kept in time order: the agent's
    /// clock is the node's (it is set at init), and an entry stamped earlier than the newest
    /// one kept is placed by its time.
    pub fn ingest(&self, id: &str, page: AgentPage) {
        let cap = self.cfg.max_entries;
        let persist = self.persist();
        self.with(id, |b| {
            let before = b.agent_next;
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
                let rec = persist.then(|| Record::Entry((&e).into()));
                if b.insert_entry(e, cap) {
                    b.pending.extend(rec);
                }
            }
            if persist && b.agent_next != before {
                let meta = b.meta();
                b.pending.push(meta);
            }
        });
    }

    pub fn sample(&self, id: &str, s: pb::SandboxStatsResponse) {
        let cap = self.cfg.max_samples;
        let persist = self.persist();
        self.with(id, |b| {
            if persist {
                b.pending.push(Record::Sample((&s).into()));
            }
            push_bounded(&mut b.samples, s, cap)
        });
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
            if self.persist() {
                let meta = b.meta();
                b.pending.push(meta);
            }
        }
    }

    /// Forgets books whose sandbox ended more than the retention ago.
    pub fn prune(&self, now_ms: u64) {
        let keep = self.cfg.retention_s.saturating_mul(1000);
        let mut gone = Vec::new();
        self.books
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|id, b| {
                let stays = b.ended_ms.is_none_or(|t| now_ms.saturating_sub(t) <= keep);
                if !stays {
                    gone.push(id.clone());
                }
                stays
            });
        for id in gone {
            if let Some(p) = self.file(&id) {
                let _ = std::fs::remove_file(p);
            }
        }
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

    fn sample_at(ts: u64) -> pb::SandboxStatsResponse {
        pb::SandboxStatsResponse {
            cpu_count: 2,
            cpu_used_pct: 12.5,
            mem_used_bytes: ts * 10,
            timestamp_ms: ts,
            ..Default::default()
        }
    }

    #[test]
    fn a_reopened_journal_has_what_was_flushed() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = JournalConfig::default();
        let j = Journal::open(cfg.clone(), dir.path()).unwrap();
        j.begin("s", 100, Some("tok".into()));
        j.event("s", "info", "Sandbox created", &[("template", "base")]);
        j.sample("s", sample_at(200));
        j.ingest(
            "s",
            AgentPage {
                next: 3,
                entries: vec![
                    agent(150, "info", "started"),
                    agent(50, "info", "template's"),
                ],
            },
        );
        j.flush();
        // More after the first flush: appended.
        j.sample("s", sample_at(300));
        j.begin("gone", 1, None);
        j.event("gone", "info", "x", &[]);
        j.flush();
        // Not flushed: lost with the process, as it would be by a SIGKILL.
        j.sample("s", sample_at(400));

        let k = Journal::open(cfg.clone(), dir.path()).unwrap();
        assert_eq!(k.samples("s", 0, 0), vec![sample_at(200), sample_at(300)]);
        let msgs: Vec<String> = k
            .logs("s", &q(0, false, "", ""))
            .into_iter()
            .map(|e| e.message)
            .collect();
        assert_eq!(
            msgs,
            j.logs("s", &q(0, false, "", ""))
                .into_iter()
                .map(|e| e.message)
                .collect::<Vec<_>>()
        );
        assert!(msgs.contains(&"started".to_string()) && !msgs.contains(&"template's".to_string()));
        assert_eq!(k.agent_next("s"), 3);
        assert_eq!(k.token("s").as_deref(), Some("tok"));
        // A sandbox no longer here ends, and goes after the retention with its file.
        k.end_missing(&["s".to_string()].into(), 1_000);
        k.prune(1_000 + cfg.retention_s * 1000 + 1);
        assert!(k.knows("s") && !k.knows("gone"));
        assert!(!dir.path().join("gone.jsonl").exists());
        assert!(dir.path().join("s.jsonl").exists());
    }

    #[test]
    fn a_torn_or_edited_file_is_not_trusted_past_the_damage() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = JournalConfig::default();
        let j = Journal::open(cfg.clone(), dir.path()).unwrap();
        j.begin("s", 0, None);
        for t in 1..=3 {
            j.sample("s", sample_at(t));
        }
        j.flush();
        let path = dir.path().join("s.jsonl");
        // A kill mid-append: half a line at the end.
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("0123456789abcdef {\"t\":\"sam");
        std::fs::write(&path, &text).unwrap();
        let k = Journal::open(cfg.clone(), dir.path()).unwrap();
        assert_eq!(k.samples("s", 0, 0).len(), 3);
        // The next flush rewrites it whole, so appends never follow a torn line.
        k.sample("s", sample_at(4));
        k.flush();
        let k2 = Journal::open(cfg.clone(), dir.path()).unwrap();
        assert_eq!(k2.samples("s", 0, 0).len(), 4);
        // An edited line: it and what follows are dropped.
        let text = std::fs::read_to_string(&path).unwrap();
        let edited = text.replacen("\"mem_used_bytes\":20", "\"mem_used_bytes\":99", 1);
        assert_ne!(edited, text);
        std::fs::write(&path, edited).unwrap();
        let k3 = Journal::open(cfg.clone(), dir.path()).unwrap();
        assert_eq!(k3.samples("s", 0, 0), vec![sample_at(1)]);
        // Another format: set aside, not read.
        std::fs::write(dir.path().join("x.jsonl"), "not a journal\n").unwrap();
        let k4 = Journal::open(cfg, dir.path()).unwrap();
        assert!(!k4.knows("x") && dir.path().join("x.bad").exists());
    }

    #[test]
    fn files_stay_bounded_and_a_reused_id_starts_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = JournalConfig {
            max_samples: 5,
            max_entries: 5,
            ..Default::default()
        };
        let j = Journal::open(cfg.clone(), dir.path()).unwrap();
        j.begin("s", 0, None);
        for t in 1..=200 {
            j.sample("s", sample_at(t));
            j.flush();
        }
        let path = dir.path().join("s.jsonl");
        let lines = std::fs::read_to_string(&path).unwrap().lines().count();
        assert!(lines <= 2 * (5 + 5) + 64 + 2, "{lines} lines");
        let k = Journal::open(cfg.clone(), dir.path()).unwrap();
        let ts: Vec<u64> = k
            .samples("s", 0, 0)
            .iter()
            .map(|s| s.timestamp_ms)
            .collect();
        assert_eq!(ts, vec![196, 197, 198, 199, 200]);
        k.end("s", 10);
        k.begin("s", 20, None);
        k.sample("s", sample_at(21));
        k.flush();
        let k2 = Journal::open(cfg, dir.path()).unwrap();
        assert_eq!(k2.samples("s", 0, 0), vec![sample_at(21)]);
    }
}
