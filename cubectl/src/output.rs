//! Output: human tables on stdout, or one JSON document with stable camelCase field names when
//! `--json` is given. Progress and notes go to stderr so stdout stays machine-readable.

use serde_json::Value;

/// Prints a JSON value on one line.
pub fn json(v: &Value) {
    println!("{v}");
}

/// A simple left-aligned table; column widths fit the widest cell.
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            rows: vec![header.iter().map(|s| s.to_string()).collect()],
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let cols = self.rows.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut width = vec![0usize; cols];
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        for r in &self.rows {
            let mut line = String::new();
            for (i, c) in r.iter().enumerate() {
                if i + 1 == r.len() {
                    line.push_str(c);
                } else {
                    line.push_str(&format!("{c:<w$}  ", w = width[i]));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }

    pub fn print(&self) {
        print!("{}", self.render());
    }
}

/// `1.5 GiB`, `12 MiB`, `512 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else if v < 10.0 {
        format!("{v:.1} {}", UNITS[u])
    } else {
        format!("{v:.0} {}", UNITS[u])
    }
}

/// Unix milliseconds as `YYYY-MM-DD HH:MM:SS` UTC; `-` for 0.
pub fn time_ms(ms: i64) -> String {
    if ms <= 0 {
        return "-".into();
    }
    let format = time::macros::format_description!("[year]-[month]-[day] [hour]:[minute]:[second]");
    time::OffsetDateTime::from_unix_timestamp(ms / 1000)
        .ok()
        .and_then(|t| t.format(&format).ok())
        .unwrap_or_else(|| "-".into())
}

/// `a, b, c` or `-` when empty.
pub fn list(v: &[String]) -> String {
    if v.is_empty() {
        "-".into()
    } else {
        v.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(300 << 20), "300 MiB");
        assert_eq!(time_ms(0), "-");
        assert_eq!(time_ms(86_400_000 + 3_661_000), "1970-01-02 01:01:01");
        assert_eq!(time_ms(1_709_251_200_000), "2024-03-01 00:00:00");
        let mut t = Table::new(&["ID", "STATE"]);
        t.row(vec!["abcdef".into(), "running".into()]);
        assert_eq!(t.render(), "ID      STATE\nabcdef  running\n");
        assert_eq!(list(&[]), "-");
    }
}
