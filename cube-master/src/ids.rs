//! Random ids: E2B-style runs of lowercase letters and digits behind a kind prefix.

use rand::Rng;

/// `prefix` followed by `len` random lowercase alphanumerics.
pub fn random_id(prefix: &str, len: usize) -> String {
    const A: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut r = rand::thread_rng();
    let tail: String = (0..len)
        .map(|_| A[r.gen_range(0..A.len())] as char)
        .collect();
    format!("{prefix}{tail}")
}
