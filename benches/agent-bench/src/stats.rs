//! Percentiles over latency samples.

use std::time::Duration;

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub samples: usize,
    pub min_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

/// Nearest-rank percentile of a sorted slice (q in 0..=1).
fn rank(sorted: &[f64], q: f64) -> f64 {
    let idx = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[idx]
}

pub fn summarize(samples: &[Duration]) -> Summary {
    let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(|a, b| a.total_cmp(b));
    if us.is_empty() {
        return Summary {
            samples: 0,
            min_us: f64::NAN,
            p50_us: f64::NAN,
            p90_us: f64::NAN,
            p95_us: f64::NAN,
            p99_us: f64::NAN,
            max_us: f64::NAN,
            mean_us: f64::NAN,
        };
    }
    Summary {
        samples: us.len(),
        min_us: us[0],
        p50_us: rank(&us, 0.50),
        p90_us: rank(&us, 0.90),
        p95_us: rank(&us, 0.95),
        p99_us: rank(&us, 0.99),
        max_us: us[us.len() - 1],
        mean_us: us.iter().sum::<f64>() / us.len() as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let d: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let s = summarize(&d);
        assert_eq!(s.p50_us, 50.0);
        assert_eq!(s.p90_us, 90.0);
        assert_eq!(s.p99_us, 99.0);
        assert_eq!(s.max_us, 100.0);
        assert_eq!(s.min_us, 1.0);
        let one = summarize(&[Duration::from_micros(7)]);
        assert_eq!(one.p50_us, 7.0);
        assert_eq!(one.p99_us, 7.0);
        assert_eq!(summarize(&[]).samples, 0);
    }
}
