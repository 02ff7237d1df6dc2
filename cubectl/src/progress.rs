//! Progress of template builds: one bar per node on a terminal, plain phase lines otherwise.

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

/// One build event, from the master's stream (per node) or a node's own stream.
#[derive(Debug, Clone, Default)]
pub struct Event {
    pub node: String,
    /// phase | progress | done | error
    pub kind: String,
    pub message: String,
    pub done: u64,
    pub total: u64,
}

pub struct BuildProgress {
    what: String,
    mp: MultiProgress,
    bars: BTreeMap<String, ProgressBar>,
    tty: bool,
}

impl BuildProgress {
    pub fn new(what: &str) -> BuildProgress {
        let tty = std::io::stderr().is_terminal();
        let target = if tty {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        BuildProgress {
            what: what.to_string(),
            mp: MultiProgress::with_draw_target(target),
            bars: BTreeMap::new(),
            tty,
        }
    }

    fn bar(&mut self, node: &str) -> ProgressBar {
        if let Some(b) = self.bars.get(node) {
            return b.clone();
        }
        let b = self.mp.add(ProgressBar::new_spinner());
        b.set_style(spinner_style());
        b.set_prefix(if node.is_empty() {
            self.what.clone()
        } else {
            format!("{} on {node}", self.what)
        });
        b.enable_steady_tick(Duration::from_millis(120));
        self.bars.insert(node.to_string(), b.clone());
        b
    }

    /// Shows one event.
    pub fn event(&mut self, e: &Event) {
        let b = self.bar(&e.node);
        let prefix = b.prefix();
        match e.kind.as_str() {
            "progress" if e.total > 0 => {
                if b.length() != Some(e.total) {
                    b.set_style(bytes_style());
                    b.set_length(e.total);
                }
                b.set_position(e.done.min(e.total));
                if !e.message.is_empty() {
                    b.set_message(e.message.clone());
                }
            }
            "done" => {
                b.finish_and_clear();
                self.line(&format!("==> {prefix}: done {}", e.message));
            }
            "error" => {
                b.abandon();
                self.line(&format!("==> {prefix}: FAILED: {}", e.message));
            }
            _ => {
                if !e.message.is_empty() {
                    b.set_message(e.message.clone());
                    if e.kind == "phase" {
                        self.line(&format!("==> {prefix}: {}", e.message));
                    }
                }
            }
        }
    }

    fn line(&self, s: &str) {
        if self.tty {
            let _ = self.mp.println(s);
        } else {
            eprintln!("{s}");
        }
    }

    /// Clears whatever is still drawn.
    pub fn finish(&mut self) {
        for b in self.bars.values() {
            if !b.is_finished() {
                b.finish_and_clear();
            }
        }
    }
}

impl Drop for BuildProgress {
    fn drop(&mut self) {
        self.finish();
    }
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} {prefix} [{elapsed}] {wide_msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

fn bytes_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{spinner} {prefix} [{elapsed}] [{bar:30}] {bytes}/{total_bytes} {wide_msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
}
