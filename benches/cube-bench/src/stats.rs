//! Latency statistics: nearest-rank percentiles over the successful samples, with failures
//! counted beside them (a run where half the creates failed must not look fast).

use serde::{Deserialize, Serialize};

/// Summary of one measured series, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Successful samples.
    pub n: usize,
    /// Attempts that failed (not in the statistics).
    pub failures: usize,
    pub min_ms: f64,
    pub avg_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Nearest-rank percentile (the smallest sample with at least `p` of the samples at or below
/// it) of an ascending slice; `None` when empty. Nearest-rank always reports a value that was
/// really measured, which is what a latency table should show.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(0.0..=1.0).contains(&p) {
        return None;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Summarises `samples` (any order, NaN dropped); `None` when there is no successful sample.
pub fn summarize(samples: &[f64], failures: usize) -> Option<Summary> {
    let mut s: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let p = |q| percentile(&s, q).unwrap_or(f64::NAN);
    Some(Summary {
        n: s.len(),
        failures,
        min_ms: s[0],
        avg_ms: s.iter().sum::<f64>() / s.len() as f64,
        p50_ms: p(0.50),
        p90_ms: p(0.90),
        p95_ms: p(0.95),
        p99_ms: p(0.99),
        max_ms: s[s.len() - 1],
    })
}

/// Points of the empirical CDF, `(latency, fraction ≤ latency)`, for plotting.
pub fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut s: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    let n = s.len() as f64;
    s.iter()
        .enumerate()
        .map(|(i, v)| (*v, (i + 1) as f64 / n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_on_one_to_hundred() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.0));
        assert_eq!(percentile(&v, 0.9), Some(90.0));
        assert_eq!(percentile(&v, 0.99), Some(99.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
    }

    #[test]
    fn percentile_of_small_and_empty_series() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        // Two samples: p50 is the lower, p51 and above the upper.
        assert_eq!(percentile(&[1.0, 2.0], 0.5), Some(1.0));
        assert_eq!(percentile(&[1.0, 2.0], 0.51), Some(2.0));
        assert_eq!(percentile(&[1.0, 2.0], 1.5), None);
    }

    #[test]
    fn summary_sorts_ignores_nan_and_keeps_failures() {
        let s = summarize(&[30.0, 10.0, f64::NAN, 20.0, 40.0], 3).unwrap();
        assert_eq!(s.n, 4);
        assert_eq!(s.failures, 3);
        assert_eq!(s.min_ms, 10.0);
        assert_eq!(s.max_ms, 40.0);
        assert_eq!(s.avg_ms, 25.0);
        assert_eq!(s.p50_ms, 20.0);
        assert_eq!(s.p90_ms, 40.0);
        assert!(summarize(&[], 5).is_none());
        assert!(summarize(&[f64::NAN], 0).is_none());
    }

    #[test]
    fn tail_percentiles_see_the_outlier() {
        // 99 fast samples and one slow one: p99 stays fast, max shows the outlier.
        let mut v = vec![5.0; 99];
        v.push(500.0);
        let s = summarize(&v, 0).unwrap();
        assert_eq!(s.p99_ms, 5.0);
        assert_eq!(s.max_ms, 500.0);
        assert!((s.avg_ms - 9.95).abs() < 1e-9);
    }

    #[test]
    fn cdf_is_monotone_and_ends_at_one() {
        let c = cdf(&[3.0, 1.0, 2.0]);
        assert_eq!(c, vec![(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]);
    }
}
