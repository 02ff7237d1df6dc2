//! Protobuf-JSON mapping helpers: int64 as strings, flexible integers, base64 bytes, timestamps.

use base64::Engine;
use serde::{Deserialize, Deserializer};
use std::time::{SystemTime, UNIX_EPOCH};

/// Base64-encodes bytes (standard alphabet, padded), as protobuf JSON does.
pub fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// Decodes protobuf-JSON bytes: standard or URL-safe alphabet, padding optional.
pub fn unb64(s: &str) -> Result<Vec<u8>, String> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let s = s.trim();
    STANDARD
        .decode(s)
        .or_else(|_| STANDARD_NO_PAD.decode(s))
        .or_else(|_| URL_SAFE.decode(s))
        .or_else(|_| URL_SAFE_NO_PAD.decode(s))
        .map_err(|e| format!("invalid base64: {e}"))
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    N(serde_json::Number),
    S(String),
}

fn num_from<E: serde::de::Error>(v: NumOrStr) -> Result<i128, E> {
    match v {
        NumOrStr::N(n) => {
            if let Some(i) = n.as_i64() {
                Ok(i as i128)
            } else if let Some(u) = n.as_u64() {
                Ok(u as i128)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if f.fract() == 0.0 && f.is_finite() {
                    Ok(f as i128)
                } else {
                    Err(E::custom(format!("expected an integer, got {n}")))
                }
            }
        }
        NumOrStr::S(s) => s
            .trim()
            .parse::<i128>()
            .map_err(|_| E::custom(format!("expected an integer, got {s:?}"))),
    }
}

/// `uint32` accepting a number or a string.
pub fn de_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = num_from::<D::Error>(NumOrStr::deserialize(d)?)?;
    u32::try_from(v)
        .map_err(|_| serde::de::Error::custom(format!("{v} is out of range for uint32")))
}

/// Optional `uint32` accepting a number, a string or null.
pub fn de_opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    match Option::<NumOrStr>::deserialize(d)? {
        None => Ok(None),
        Some(v) => {
            let v = num_from::<D::Error>(v)?;
            u32::try_from(v)
                .map(Some)
                .map_err(|_| serde::de::Error::custom(format!("{v} is out of range for uint32")))
        }
    }
}

/// `bool` that also accepts null (as false).
pub fn de_bool<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// Formats a time as RFC 3339 in UTC with nine fractional digits: protobuf JSON's
/// `Timestamp` (its parsers take 3, 6 or 9 digits, so trimming is not an option).
pub fn rfc3339(t: SystemTime) -> String {
    let t = time::OffsetDateTime::from(t);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:09}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.nanosecond()
    )
}

/// Seconds since the epoch (0 for times before it).
pub fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Deserializes `null` as the type's default (proto3 JSON treats null as "unset").
pub fn de_null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct T {
        #[serde(deserialize_with = "de_u32")]
        n: u32,
    }

    #[test]
    fn numbers_as_strings_or_numbers() {
        assert_eq!(serde_json::from_str::<T>(r#"{"n":"5"}"#).unwrap().n, 5);
        assert_eq!(serde_json::from_str::<T>(r#"{"n":7}"#).unwrap().n, 7);
        assert!(serde_json::from_str::<T>(r#"{"n":-1}"#).is_err());
        assert!(serde_json::from_str::<T>(r#"{"n":"x"}"#).is_err());
        assert!(serde_json::from_str::<T>(r#"{"n":1.5}"#).is_err());
    }

    #[test]
    fn base64_variants() {
        assert_eq!(unb64("aGkK").unwrap(), b"hi\n");
        assert_eq!(unb64("aGk").unwrap(), b"hi");
        assert_eq!(unb64("-_8").unwrap(), vec![0xfb, 0xff]);
        assert!(unb64("!!").is_err());
    }

    #[test]
    fn timestamps() {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::new(1_704_067_200, 5_000);
        assert_eq!(rfc3339(t), "2024-01-01T00:00:00.000005000Z");
        assert_eq!(unix_secs(t), 1704067200);
    }
}
