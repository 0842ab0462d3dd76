//! File metadata (envd 0.6.2): the guest's extended attributes `user.e2b.<key>`, read in
//! batches for `EntryInfo`, and the `X-Metadata-<key>` headers of an upload checked into
//! the attributes it sets (bounded in count, key and value length, printable ASCII only).
//! Separate because both the entries and the uploads use it.

use std::collections::HashMap;

use axum::http::HeaderMap;

use crate::envd::{pb, SandboxConn, User};

/// The extended-attribute namespace of file metadata (envd's): `user.e2b.<key>`.
pub(crate) const META_PREFIX: &str = "user.e2b.";
/// Paths asked about in one GetXattrs.
const META_BATCH: usize = 256;
/// Most metadata entries one upload may set.
const MAX_META: usize = 64;

/// Metadata as `EntryInfo` shows it: the keys without the prefix.
pub(super) fn meta_map(l: Vec<(String, Vec<u8>)>) -> HashMap<String, String> {
    l.into_iter()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix(META_PREFIX)?.to_string();
            Some((key, String::from_utf8_lossy(&v).into_owned()))
        })
        .collect()
}

/// Fills the metadata of `entries` (one GetXattrs per [`META_BATCH`] of them). A guest
/// agent older than the operation, or a filesystem without extended attributes, leaves
/// them without any.
pub(super) fn fill_metadata(sb: &SandboxConn, user: &User, entries: &mut [pb::EntryInfo]) {
    for chunk in entries.chunks_mut(META_BATCH) {
        let paths: Vec<std::path::PathBuf> = chunk.iter().map(|e| e.path.clone().into()).collect();
        match sb.with_user(user, |c| c.get_xattrs(&paths, META_PREFIX)) {
            Ok(lists) => {
                for (e, l) in chunk.iter_mut().zip(lists) {
                    e.metadata = meta_map(l);
                }
            }
            Err(e) => {
                tracing::debug!(sandbox = %sb.id, "file metadata not read: {}", e.message);
                return;
            }
        }
    }
}

/// The metadata an upload sets (`X-Metadata-<key>: value`, keys lowercased), as full
/// attribute names, or why it cannot be set.
pub(crate) fn upload_metadata(h: &HeaderMap) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut out = Vec::new();
    for (name, value) in h {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        if key.is_empty() || key.len() > 200 {
            return Err(format!("metadata key {key:?}: 1 to 200 characters"));
        }
        let v = value
            .to_str()
            .ok()
            .filter(|v| v.len() <= 4096 && v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| {
                format!("metadata {key:?}: the value must be printable ASCII, at most 4096 bytes")
            })?;
        out.push((
            format!("{META_PREFIX}{}", key.to_ascii_lowercase()),
            v.as_bytes().to_vec(),
        ));
    }
    if out.len() > MAX_META {
        return Err(format!("at most {MAX_META} metadata entries per upload"));
    }
    out.sort();
    out.dedup_by(|a, b| a.0 == b.0);
    Ok(out)
}
