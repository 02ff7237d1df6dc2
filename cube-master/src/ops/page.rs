//! Pages of the master's listings (sandboxes, secrets, snapshots): at most [`MAX`] rows, and a
//! token naming the last row shown by the listing's sort key, `<unix ms>.<id>`, from which the
//! next page starts.

use crate::error::MasterError;

/// The most rows one page holds.
pub const MAX: usize = 100;

/// The page size a request asks for: 0 means the most.
pub fn size(limit: u32) -> usize {
    if limit == 0 {
        MAX
    } else {
        (limit as usize).min(MAX)
    }
}

/// The sort key a token names; the empty token is the first page.
pub fn after(token: &str) -> Result<Option<(i64, String)>, MasterError> {
    if token.is_empty() {
        return Ok(None);
    }
    token
        .split_once('.')
        .and_then(|(ms, id)| Some((ms.parse::<i64>().ok()?, id.to_string())))
        .map(Some)
        .ok_or_else(|| MasterError::InvalidArgument("invalid next token".into()))
}

/// Cuts `rows`, fetched up to one past `size`, to the page, with the next page's token (empty
/// when this is the last page). `key` is a row's sort key.
pub fn cut<T>(mut rows: Vec<T>, size: usize, key: impl Fn(&T) -> (i64, &str)) -> (Vec<T>, String) {
    let more = rows.len() > size;
    rows.truncate(size);
    let token = match (more, rows.last()) {
        (true, Some(r)) => {
            let (ms, id) = key(r);
            format!("{ms}.{id}")
        }
        _ => String::new(),
    };
    (rows, token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_the_last_row_of_a_full_page() {
        assert_eq!((size(0), size(7), size(1000)), (MAX, 7, MAX));
        let rows: Vec<(i64, String)> = (0..5).map(|i| (i, format!("r{i}"))).collect();
        fn key(r: &(i64, String)) -> (i64, &str) {
            (r.0, r.1.as_str())
        }
        let (page, token) = cut(rows.clone(), 3, key);
        assert_eq!((page.len(), token.as_str()), (3, "2.r2"));
        assert_eq!(after(&token).unwrap(), Some((2, "r2".to_string())));
        let (page, token) = cut(rows, 5, key);
        assert_eq!((page.len(), token.as_str()), (5, ""));
        assert_eq!(after("").unwrap(), None);
        for bad in ["x", "1", "a.b", ".id"] {
            assert!(after(bad).is_err(), "{bad:?}");
        }
    }
}
