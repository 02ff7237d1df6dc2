//! PNG plots with plotters. Text is drawn with ab_glyph from a TrueType font found on the host
//! (Debian: `fonts-dejavu-core`) or given with `--font`; without one the plots are skipped with
//! a note rather than drawn unlabelled.

use crate::report::{LatencyRow, LifecycleRow, Report};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::error::Error;
use std::path::{Path, PathBuf};

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
];

fn find_ttf(dir: &Path, depth: usize) -> Option<PathBuf> {
    let mut entries: Vec<_> = std::fs::read_dir(dir).ok()?.flatten().collect();
    entries.sort_by_key(|e| e.path());
    for e in &entries {
        let p = e.path();
        if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("ttf")) {
            return Some(p);
        }
    }
    if depth == 0 {
        return None;
    }
    entries
        .iter()
        .filter(|e| e.path().is_dir())
        .find_map(|e| find_ttf(&e.path(), depth - 1))
}

/// Registers a font as "sans-serif"; returns the file used.
pub fn load_font(explicit: Option<&Path>) -> Result<PathBuf, String> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => FONT_CANDIDATES
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .or_else(|| find_ttf(Path::new("/usr/share/fonts"), 3))
            .ok_or("no TrueType font found under /usr/share/fonts (install fonts-dejavu-core or pass --font FILE.ttf)")?,
    };
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    // plotters keeps registered fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("{}: not a usable TrueType font", path.display()))?;
    Ok(path)
}

type Res = Result<(), Box<dyn Error>>;

/// Dark, distinguishable line colours (no yellow on white).
const COLORS: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 150, 170),
    RGBColor(140, 86, 75),
    RGBColor(60, 60, 60),
];

struct Line {
    label: String,
    points: Vec<(f64, f64)>,
}

fn nice_max(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v * 1.1
    } else {
        1.0
    }
}

fn draw_lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    lines: &[Line],
    y_max: Option<f64>,
) -> Res {
    let xmax = nice_max(
        lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.0))
            .fold(0.0, f64::max),
    );
    let ymax = y_max.unwrap_or_else(|| {
        nice_max(
            lines
                .iter()
                .flat_map(|l| l.points.iter().map(|p| p.1))
                .fold(0.0, f64::max),
        )
    });
    // Negative values (a density step where MemAvailable rose) must stay visible.
    let ymin = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .fold(0.0, f64::min)
        * 1.1;
    let root = BitMapBackend::new(path, (1100, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 15))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax, ymin..ymax)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style(("sans-serif", 14))
        .draw()?;
    for (i, l) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()].to_rgba();
        chart
            .draw_series(LineSeries::new(
                l.points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(l.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        if l.points.len() < 30 {
            chart.draw_series(l.points.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn cdf_lines(rows: &[LatencyRow]) -> Vec<Line> {
    rows.iter()
        .filter(|r| !r.samples_ms.is_empty())
        .map(|r| Line {
            label: format!(
                "c={} (n={}{}, p50 {:.1} ms, p99 {:.1} ms)",
                r.concurrency,
                r.samples_ms.len(),
                if r.failures > 0 {
                    format!(", {} failed", r.failures)
                } else {
                    String::new()
                },
                r.summary.as_ref().map(|s| s.p50_ms).unwrap_or(f64::NAN),
                r.summary.as_ref().map(|s| s.p99_ms).unwrap_or(f64::NAN)
            ),
            points: crate::stats::cdf(&r.samples_ms),
        })
        .collect()
}

fn lifecycle_lines(rows: &[LifecycleRow]) -> Vec<Line> {
    let mut names: Vec<&String> = rows.iter().flat_map(|r| r.ops.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter_map(|n| {
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter_map(|r| {
                    let s = r.ops.get(n)?.summary.as_ref()?;
                    Some((r.dirty_mib as f64, s.p50_ms))
                })
                .collect();
            (!points.is_empty()).then(|| Line {
                label: format!("{n} p50"),
                points,
            })
        })
        .collect()
}

/// Writes every plot there is data for into `dir`; returns the files written and notes.
pub fn write_all(r: &Report, dir: &Path) -> (Vec<PathBuf>, Vec<String>) {
    let ctx = format!(
        "{} runtime, {}",
        r.environment.runtime,
        r.environment.machine.short()
    );
    let mut written = Vec::new();
    let mut notes = Vec::new();
    let mut plot =
        |name: &str, title: String, x: &str, y: &str, lines: Vec<Line>, ymax: Option<f64>| {
            if lines.is_empty() {
                notes.push(format!("{name}: no data"));
                return;
            }
            let p = dir.join(name);
            match draw_lines(&p, &title, x, y, &lines, ymax) {
                Ok(()) => written.push(p),
                Err(e) => notes.push(format!("{name}: {e}")),
            }
        };
    plot(
        "create-latency-cdf.png",
        format!("Create latency distribution per concurrency — {ctx}"),
        "create latency (ms): POST /v2/sandboxes → 201",
        "fraction of creates ≤ x",
        cdf_lines(&r.create_latency.rows),
        Some(1.02),
    );
    plot(
        "first-command-cdf.png",
        format!("Create → `echo hi` done, per concurrency — {ctx}"),
        "create + first command (ms)",
        "fraction ≤ x",
        cdf_lines(&r.create_to_first_command.rows),
        Some(1.02),
    );
    let mut tl = Vec::new();
    for mode in ["create-delete", "create-only"] {
        let points: Vec<(f64, f64)> = r
            .throughput
            .rows
            .iter()
            .filter(|t| t.mode == mode && t.ok > 0)
            .map(|t| (t.concurrency as f64, t.creates_per_s))
            .collect();
        if !points.is_empty() {
            tl.push(Line {
                label: mode.into(),
                points,
            });
        }
    }
    plot(
        "throughput.png",
        format!("Create throughput vs concurrency — {ctx}"),
        "concurrent clients",
        "successful creates per second",
        tl,
        None,
    );
    let dl: Vec<(f64, f64)> = r
        .density
        .rows
        .iter()
        .filter(|d| d.live > 0 && d.per_sandbox_mib.is_finite())
        .map(|d| (d.live as f64, d.per_sandbox_mib))
        .collect();
    plot(
        "density.png",
        format!("Host MiB per idle sandbox (MemAvailable drop) — {ctx}"),
        "live idle sandboxes",
        "MiB per sandbox",
        if dl.is_empty() {
            vec![]
        } else {
            vec![Line {
                label: "MiB per sandbox".into(),
                points: dl,
            }]
        },
        None,
    );
    let mut ll = lifecycle_lines(&r.pause_resume.rows);
    ll.extend(lifecycle_lines(&r.snapshot_clone.rows));
    plot(
        "lifecycle-vs-dirty.png",
        format!("Pause/resume/snapshot/clone/fork vs dirty memory — {ctx}"),
        "MiB written in the sandbox before the operation",
        "latency p50 (ms)",
        ll,
        None,
    );
    (written, notes)
}
