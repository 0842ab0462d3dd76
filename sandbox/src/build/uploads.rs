//! The files of COPY steps, uploaded by content hash: the signed upload link (good for
//! [`UPLOAD_LINK_LIFETIME_S`], bound to its hash and expiry), the upload streamed to a
//! scratch file and kept as a checked, size-bounded tar
//! (`<state dir>/build-files/<hash>.tar`), and a second upload of a hash accepted only
//! with the same files.

use std::io::Read;

use sha2::{Digest, Sha256};

use super::*;

/// A digest of the files a tar holds, as far as the SDK's files hash covers them: each
/// entry's path, type, permission bits, link target and contents, in order (owners and
/// times left out).
fn tar_files_digest(tar_path: &Path) -> Result<[u8; 32]> {
    fn field(h: &mut Sha256, b: &[u8]) {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    }
    let f = std::fs::File::open(tar_path).map_err(Error::io("reading", tar_path))?;
    let bad =
        |e: std::io::Error| Error::BadRequest(format!("the upload is not a tar archive: {e}"));
    let mut a = tar::Archive::new(std::io::BufReader::new(f));
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    for e in a.entries().map_err(bad)? {
        let mut e = e.map_err(bad)?;
        field(&mut h, &e.path_bytes());
        field(&mut h, &[e.header().entry_type().as_byte()]);
        field(&mut h, &e.header().mode().map_err(bad)?.to_le_bytes());
        field(&mut h, &e.link_name_bytes().unwrap_or_default());
        h.update(e.size().to_le_bytes());
        loop {
            let n = e.read(&mut buf).map_err(bad)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.finalize().into())
}

/// A files hash as the SDK makes it: 64 lowercase hex digits (never a path).
pub(super) fn check_hash(h: &str) -> Result<()> {
    if h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(())
    } else {
        Err(Error::BadRequest(format!("'{h}' is not a files hash")))
    }
}

impl Builds {
    /// Whether the files of `hash` were uploaded.
    pub fn files_present(&self, hash: &str) -> Result<bool> {
        check_hash(hash)?;
        Ok(self.files_dir().join(format!("{hash}.tar")).is_file())
    }

    /// The token an upload of `hash` must carry until `expires` (unix seconds): its link
    /// is given with the API key, and the token binds it to both (a link for one hash, or
    /// with its expiry moved, is no link).
    pub fn upload_token(&self, hash: &str, expires: i64) -> String {
        let mut h = Sha256::new();
        h.update(self.secret);
        h.update(b"upload:");
        h.update(hash);
        h.update(b":");
        h.update(expires.to_string());
        hex(h.finalize())
    }

    /// The path of an upload link for the files of `hash` issued at `now_s` (unix
    /// seconds): `/build-files/{hash}/{expires}/{token}`, good for
    /// [`UPLOAD_LINK_LIFETIME_S`].
    pub fn upload_link_path(&self, hash: &str, now_s: i64) -> String {
        let expires = now_s.saturating_add(UPLOAD_LINK_LIFETIME_S);
        format!(
            "/build-files/{hash}/{expires}/{}",
            self.upload_token(hash, expires)
        )
    }

    /// Checks the upload link of the files of `hash` (`expires` and `token` from
    /// [`Builds::upload_link_path`]) at `now_s` before anything of its body is read, and
    /// returns where the body goes as it arrives (a scratch file of the build files'
    /// directory, given to [`Builds::keep_upload`]).
    pub fn upload_scratch(
        &self,
        hash: &str,
        expires: &str,
        token: &str,
        now_s: i64,
    ) -> Result<PathBuf> {
        check_hash(hash)?;
        let invalid = || Error::BadRequest("this upload link is not valid".into());
        let expires: i64 = expires.parse().map_err(|_| invalid())?;
        let want = self.upload_token(hash, expires);
        if !crate::envd::access::same_secret(token.as_bytes(), want.as_bytes()) {
            return Err(invalid());
        }
        if expires < now_s {
            return Err(Error::BadRequest(
                "this upload link has expired: ask for the files' link again".into(),
            ));
        }
        let dir = self.files_dir();
        std::fs::create_dir_all(&dir).map_err(Error::io("creating", &dir))?;
        Ok(dir.join(format!(".{hash}.{}.upload", crate::ids::random_string(12))))
    }

    /// Keeps an upload of the files of `hash` received into `raw` (from
    /// [`Builds::upload_scratch`]; removed whatever happens): a gzipped or plain tar,
    /// stored decompressed and checked to be a tar.
    ///
    /// The files of a hash, once kept, never change: builds that name the hash get what
    /// was first uploaded for it. A later upload for the same hash must hold the same
    /// files (paths, types, modes, link targets and contents: what the SDK's hash covers;
    /// not owners or times, which it leaves out) and is then a no-op; other files are
    /// refused (409) and nothing of them is kept. The SDK's hash itself cannot be checked
    /// here: it also covers the COPY step's source and destination (known only when the
    /// build starts) and the client's directory sizes (not in a tar).
    pub fn keep_upload(&self, hash: &str, raw: &Path) -> Result<()> {
        let r = self.unpack_upload(hash, raw);
        let _ = std::fs::remove_file(raw);
        r
    }

    fn unpack_upload(&self, hash: &str, raw: &Path) -> Result<()> {
        check_hash(hash)?;
        let mut file = std::fs::File::open(raw).map_err(Error::io("reading", raw))?;
        use std::io::Seek;
        let mut magic = [0u8; 2];
        let gz = matches!(file.read(&mut magic), Ok(2) if magic == [0x1f, 0x8b]);
        file.rewind().map_err(Error::io("reading", raw))?;
        let mut data: Box<dyn Read> = if gz {
            Box::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)))
        } else {
            Box::new(std::io::BufReader::new(file))
        };
        let dir = self.files_dir();
        let tmp = dir.join(format!(".{hash}.{}.tar", crate::ids::random_string(12)));
        let mut out = std::fs::File::create(&tmp).map_err(Error::io("creating", &tmp))?;
        let n = std::io::copy(&mut (&mut data).take(MAX_UNPACKED + 1), &mut out);
        let r = match n {
            Ok(n) if n > MAX_UNPACKED => Err(Error::BadRequest(format!(
                "the files unpack to more than {MAX_UNPACKED} bytes"
            ))),
            Ok(_) => {
                // Every entry readable: a truncated or corrupt tar is refused now.
                let f = std::fs::File::open(&tmp).map_err(Error::io("reading", &tmp))?;
                let mut a = tar::Archive::new(clade_image::TarLimit::new(f));
                a.entries()
                    .and_then(|mut es| es.try_for_each(|e| e.map(|_| ())))
                    .map_err(|e| Error::BadRequest(format!("the upload is not a tar archive: {e}")))
            }
            Err(e) => Err(Error::BadRequest(format!("the upload: {e}"))),
        };
        let r = r.and_then(|()| {
            // A hard link never replaces: two uploads of one hash at once keep one.
            let dst = dir.join(format!("{hash}.tar"));
            match std::fs::hard_link(&tmp, &dst) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if tar_files_digest(&tmp)? == tar_files_digest(&dst)? {
                        Ok(())
                    } else {
                        Err(Error::Conflict(format!(
                            "the files of {hash} were uploaded before, with other contents; \
                             files are kept by their hash and never replaced"
                        )))
                    }
                }
                Err(e) => Err(Error::io("linking", &dst)(e)),
            }
        });
        let _ = std::fs::remove_file(&tmp);
        r
    }

    /// [`Builds::upload_scratch`], the whole of `body` written there, then
    /// [`Builds::keep_upload`].
    #[cfg(test)]
    pub(super) fn store_upload(
        &self,
        hash: &str,
        expires: i64,
        token: &str,
        body: &[u8],
    ) -> Result<()> {
        let now = crate::ids::now_ms() / 1000;
        let raw = self.upload_scratch(hash, &expires.to_string(), token, now)?;
        std::fs::write(&raw, body).map_err(Error::io("writing", &raw))?;
        self.keep_upload(hash, &raw)
    }
}
