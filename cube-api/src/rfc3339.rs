//! Times in E2B's JSON: RFC 3339 text both ways.

/// An RFC 3339 time (UTC, `Z`) of unix milliseconds, as E2B's JSON carries times.
pub(crate) fn format(ms: i64) -> String {
    use time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_default()
}

/// Unix milliseconds of an RFC 3339 time with any offset (what the SDKs send:
/// `datetime.isoformat()`, `Date.toISOString()`).
pub(crate) fn parse_ms(s: &str) -> Option<i64> {
    use time::format_description::well_known::Rfc3339;
    let t = time::OffsetDateTime::parse(s, &Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_format() {
        assert_eq!(format(0), "1970-01-01T00:00:00Z");
        assert_eq!(format(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(format(951_782_400_000), "2000-02-29T00:00:00Z");
        for ms in [0, 1_700_000_000_123, 951_782_400_000] {
            assert_eq!(parse_ms(&format(ms)), Some(ms));
        }
        // Python's isoformat() with an offset and microseconds.
        assert_eq!(
            parse_ms("2023-11-14T23:13:20.123456+01:00"),
            Some(1_700_000_000_123)
        );
        assert_eq!(parse_ms("yesterday"), None);
        assert_eq!(parse_ms("2023-11-14"), None);
    }
}
