//! Request bodies read field by field, strictly: every field is taken by name, and whatever
//! is left at the end is refused with a 400 that names it, so no field is silently ignored.

use crate::error::ApiError;
use axum::body::Bytes;
use serde_json::{Map, Value};

/// A JSON object body (or a nested object of one) whose fields are taken one by one.
pub(crate) struct Fields {
    map: Map<String, Value>,
    /// Where these fields sit, for messages: `""` for the body, `"network."` below it.
    prefix: String,
}

impl Fields {
    /// Parses a JSON object body; an empty body is `{}` when `allow_empty`.
    pub fn parse(body: &Bytes, allow_empty: bool) -> Result<Fields, ApiError> {
        let map = if body.iter().all(|b| b.is_ascii_whitespace()) {
            if !allow_empty {
                return Err(ApiError::bad_request("Request body is required"));
            }
            Map::new()
        } else {
            match serde_json::from_slice::<Value>(body) {
                Ok(Value::Object(m)) => m,
                Ok(_) => return Err(ApiError::bad_request("Request body must be a JSON object")),
                Err(e) => return Err(ApiError::bad_request(format!("Invalid JSON body: {e}"))),
            }
        };
        Ok(Fields {
            map,
            prefix: String::new(),
        })
    }

    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The field's value; JSON `null` counts as absent.
    pub fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key).filter(|v| !v.is_null())
    }

    pub fn bool(&mut self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(ApiError::bad_request(format!(
                "{} must be a boolean",
                self.name(key)
            ))),
        }
    }

    pub fn string(&mut self, key: &str) -> Result<Option<String>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::bad_request(format!(
                "{} must be a string",
                self.name(key)
            ))),
        }
    }

    /// An integer field.
    pub fn int(&mut self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Ok(Some(i)),
                (None, Some(u)) => Ok(Some(i64::try_from(u).unwrap_or(i64::MAX))),
                _ => Err(ApiError::bad_request(format!(
                    "{} must be an integer",
                    self.name(key)
                ))),
            },
            Some(_) => Err(ApiError::bad_request(format!(
                "{} must be an integer",
                self.name(key)
            ))),
        }
    }

    /// `timeout` in seconds: an integer > 0 (the master checks the maximum).
    pub fn timeout(&mut self, default: Option<u64>) -> Result<u64, ApiError> {
        match self.int("timeout")? {
            None => default.ok_or_else(|| ApiError::bad_request("timeout is required")),
            Some(t) if t <= 0 => Err(ApiError::bad_request("Timeout must be greater than 0")),
            Some(t) => Ok(t as u64),
        }
    }

    /// A nested object, read with its own `Fields` (finish it too).
    pub fn object(&mut self, key: &str) -> Result<Option<Fields>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields {
                map,
                prefix: format!("{}.", self.name(key)),
            })),
            Some(_) => Err(ApiError::bad_request(format!(
                "{} must be an object",
                self.name(key)
            ))),
        }
    }

    /// A list of strings (absent or `null` = empty).
    pub fn string_list(&mut self, key: &str) -> Result<Vec<String>, ApiError> {
        let bad = |f: &Fields| {
            ApiError::bad_request(format!("{} must be a list of strings", f.name(key)))
        };
        match self.take(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(bad(self)),
                })
                .collect(),
            Some(_) => Err(bad(self)),
        }
    }

    /// A `{string: string}` object (absent or `null` = empty).
    pub fn string_map(
        &mut self,
        key: &str,
    ) -> Result<std::collections::HashMap<String, String>, ApiError> {
        Ok(self.opt_string_map(key)?.unwrap_or_default())
    }

    /// A `{string: string}` object, `None` when absent or `null`.
    pub fn opt_string_map(
        &mut self,
        key: &str,
    ) -> Result<Option<std::collections::HashMap<String, String>>, ApiError> {
        let Some(mut o) = self.object(key)? else {
            return Ok(None);
        };
        let prefix = o.prefix.clone();
        std::mem::take(&mut o.map)
            .into_iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k, s)),
                _ => Err(ApiError::bad_request(format!(
                    "{prefix}{k} must be a string"
                ))),
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// A field Cube does not implement: absent, `null` or empty (`[]`, `{}`, `""`) is fine,
    /// anything else is refused by name with `why`.
    pub fn unsupported(&mut self, key: &str, why: &str) -> Result<(), ApiError> {
        match self.take(key) {
            None => Ok(()),
            Some(v) if is_empty(&v) => Ok(()),
            Some(_) => Err(unsupported(&self.name(key), why)),
        }
    }

    /// Refuses whatever field was not taken.
    pub fn finish(self) -> Result<(), ApiError> {
        if self.map.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = self.map.keys().map(|k| self.name(k)).collect();
        Err(ApiError::bad_request(format!(
            "unknown field{} {}: Cube does not implement {}",
            if names.len() == 1 { "" } else { "s" },
            names.join(", "),
            if names.len() == 1 { "it" } else { "them" },
        )))
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        // `{"github": {}}` asks for something: only `{}` is empty.
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// The 400 for an option Cube does not implement.
pub(crate) fn unsupported(field: &str, why: &str) -> ApiError {
    ApiError::bad_request(format!("{field} is not supported by Cube: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(s: &str) -> Fields {
        Fields::parse(&Bytes::from(s.to_string()), true).unwrap()
    }

    #[test]
    fn leftovers_are_named() {
        let mut b = f(r#"{"a": 1, "zz": 2, "network": {"x": 1}}"#);
        assert_eq!(b.int("a").unwrap(), Some(1));
        let mut n = b.object("network").unwrap().unwrap();
        let e = b.finish().unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("unknown field zz"), "{}", e.message);
        let e = {
            n.bool("y").unwrap();
            n.finish().unwrap_err()
        };
        assert!(e.message.contains("network.x"), "{}", e.message);
        assert!(f("{}").finish().is_ok());
        assert!(f("").finish().is_ok());
    }

    #[test]
    fn nulls_and_empties_are_absent_but_values_are_refused() {
        let mut b = f(r#"{"mcp": null, "iam": {}, "v": [], "w": [1]}"#);
        assert!(b.unsupported("mcp", "x").is_ok());
        assert!(b.unsupported("iam", "x").is_ok());
        assert!(b.unsupported("v", "x").is_ok());
        let e = b.unsupported("w", "no volumes").unwrap_err();
        assert!(e.message.contains("w is not supported by Cube: no volumes"));
        assert!(b.finish().is_ok());
    }

    #[test]
    fn types_are_checked() {
        assert!(f(r#"{"a": "x"}"#).bool("a").is_err());
        assert!(f(r#"{"a": 1.5}"#).int("a").is_err());
        assert!(f(r#"{"a": 1}"#).string("a").is_err());
        assert!(f(r#"{"a": []}"#).object("a").is_err());
        assert!(f(r#"{"m": {"k": 1}}"#).string_map("m").is_err());
        assert_eq!(f(r#"{"timeout": 7}"#).timeout(None).unwrap(), 7);
        assert_eq!(f("{}").timeout(Some(5)).unwrap(), 5);
        assert!(f(r#"{"timeout": 0}"#).timeout(None).is_err());
        assert!(f(r#"{"timeout": -3}"#).timeout(None).is_err());
        assert!(f(r#"{"timeout": "x"}"#).timeout(None).is_err());
        assert!(f("{}").timeout(None).is_err());
        assert!(Fields::parse(&Bytes::from_static(b"[1]"), true).is_err());
        assert!(Fields::parse(&Bytes::from_static(b"{"), true).is_err());
        assert!(Fields::parse(&Bytes::new(), false).is_err());
    }
}
