//! E2B's list paging, as every list handler speaks it: `limit` (1–100; absent = the master's
//! default) and `nextToken` in the query, the next page's token in `X-Next-Token`.

use crate::error::ApiError;
use axum::http::{HeaderMap, HeaderValue};
use std::collections::HashMap;

/// The query's `limit`; 0 when absent.
pub fn limit(q: &HashMap<String, String>) -> Result<u32, ApiError> {
    match q.get("limit") {
        None => Ok(0),
        Some(l) => match l.parse::<u32>() {
            Ok(n) if (1..=100).contains(&n) => Ok(n),
            _ => Err(ApiError::bad_request("limit must be between 1 and 100")),
        },
    }
}

/// The query's `nextToken` ("" = the first page).
pub fn next_token(q: &HashMap<String, String>) -> String {
    q.get("nextToken").cloned().unwrap_or_default()
}

/// The response headers announcing the next page (none on the last one).
pub fn next_page_headers(token: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if !token.is_empty() {
        if let Ok(v) = HeaderValue::from_str(token) {
            headers.insert("x-next-token", v);
        }
    }
    headers
}
