//! Identifiers and times as the E2B API writes them: sandbox ids are 20 lowercase
//! alphanumerics (E2B's look like `i1a2b3c4d5e6f7g8h9j0`), times RFC 3339 in UTC.

use chrono::{DateTime, SecondsFormat, Utc};

const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

/// A new random sandbox id (20 characters of [a-z0-9], starting with a letter).
pub fn new_sandbox_id() -> String {
    random_string(20)
}

/// `n` random characters of [a-z0-9], the first a letter.
pub fn random_string(n: usize) -> String {
    let mut bytes = vec![0u8; n];
    // The OS random source failing is not recoverable here; fall back to time-derived
    // bytes rather than panic (uniqueness is still checked by the registry's primary key).
    if getrandom::fill(&mut bytes).is_err() {
        let t = Utc::now().timestamp_nanos_opt().unwrap_or_default() as u64;
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (t >> ((i % 8) * 8)) as u8 ^ (i as u8).wrapping_mul(37);
        }
    }
    bytes
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if i == 0 {
                ALPHABET[*b as usize % 26] as char
            } else {
                ALPHABET[*b as usize % ALPHABET.len()] as char
            }
        })
        .collect()
}

/// A new secret token (a sandbox's envd or traffic access token): 32 bytes from the OS
/// random source, as hex. No fallback: a token that could be guessed is worse than none.
pub fn new_token() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|e| std::io::Error::other(format!("random source: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `s` could be a sandbox id this host issued (used to reject path tricks early).
pub fn valid_sandbox_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Now, in milliseconds since the epoch.
pub fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

/// RFC 3339 (UTC, milliseconds, `Z`) for a time in milliseconds since the epoch.
pub fn rfc3339(ms: i64) -> String {
    DateTime::<Utc>::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Parses an RFC 3339 time into milliseconds since the epoch.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.timestamp_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_look_like_e2b_ids() {
        let a = new_sandbox_id();
        let b = new_sandbox_id();
        assert_eq!(a.len(), 20);
        assert_ne!(a, b);
        assert!(valid_sandbox_id(&a));
        assert!(a.as_bytes()[0].is_ascii_lowercase());
        assert!(!valid_sandbox_id("../etc"));
        assert!(!valid_sandbox_id(""));
        assert!(!valid_sandbox_id("ABC"));
    }

    #[test]
    fn times_round_trip() {
        let t = 1_700_000_000_123;
        let s = rfc3339(t);
        assert_eq!(s, "2023-11-14T22:13:20.123Z");
        assert_eq!(parse_rfc3339(&s), Some(t));
        assert_eq!(parse_rfc3339("2023-11-14T23:13:20.123+01:00"), Some(t));
        assert_eq!(parse_rfc3339("yesterday"), None);
    }
}
