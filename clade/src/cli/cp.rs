//! `clade cp`: copy one file between the host and the guest through the agent.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use vmm::agent::{Client, FileKind};

use super::exec::AgentOpts;
use super::progress::Bar;

#[derive(Debug, Args)]
pub struct CpArgs {
    /// Source: a host path (`-` for stdin) or SOCKET:GUEST_PATH.
    src: String,
    /// Destination: a host path (`-` for stdout) or SOCKET:GUEST_PATH. An existing
    /// directory (or a path ending in `/`) receives the file under its own name.
    dst: String,
    #[command(flatten)]
    agent: AgentOpts,
}

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Location {
    Host(PathBuf),
    /// `SOCKET:PATH`, where SOCKET is an existing Unix socket on the host.
    Guest {
        socket: PathBuf,
        path: PathBuf,
    },
}

/// `SOCKET:PATH` when the part before the first `:` is an existing Unix socket; anything
/// else is a host path.
fn parse_location(s: &str) -> Location {
    if let Some((sock, path)) = s.split_once(':') {
        let is_socket = fs::metadata(sock)
            .map(|m| m.file_type().is_socket())
            .unwrap_or(false);
        if is_socket && !path.is_empty() {
            return Location::Guest {
                socket: sock.into(),
                path: path.into(),
            };
        }
    }
    Location::Host(s.into())
}

fn file_name(p: &Path) -> anyhow::Result<&std::ffi::OsStr> {
    p.file_name()
        .with_context(|| format!("{}: no file name to copy to a directory", p.display()))
}

pub fn cp(args: CpArgs) -> anyhow::Result<u8> {
    match (parse_location(&args.src), parse_location(&args.dst)) {
        (Location::Host(src), Location::Guest { socket, path }) => {
            let client = args.agent.connect(&socket)?;
            upload(&client, &src, &path)
        }
        (Location::Guest { socket, path }, Location::Host(dst)) => {
            let client = args.agent.connect(&socket)?;
            download(&client, &path, &dst)
        }
        (Location::Guest { .. }, Location::Guest { .. }) => {
            bail!("both sides are in a guest; copy through the host")
        }
        (Location::Host(_), Location::Host(_)) => bail!(
            "neither side is SOCKET:GUEST_PATH (SOCKET must be an existing Unix socket, e.g. \
             the VM's vsock socket)"
        ),
    }?;
    Ok(0)
}

fn upload(client: &Client, src: &Path, dst: &Path) -> anyhow::Result<()> {
    let mut dst = dst.to_path_buf();
    let dst_is_dir = dst.as_os_str().as_encoded_bytes().ends_with(b"/")
        || client
            .stat(&dst)
            .map(|s| s.kind == FileKind::Dir)
            .unwrap_or(false);
    if src == Path::new("-") {
        if dst_is_dir {
            bail!("{}: a directory; name the file for stdin", dst.display());
        }
        client.write_file_from(&dst, 0o644, &mut io::stdin().lock())?;
        return Ok(());
    }
    let file = File::open(src).with_context(|| format!("open {}", src.display()))?;
    let meta = file.metadata()?;
    if meta.is_dir() {
        bail!("{}: copying directories is not supported", src.display());
    }
    if dst_is_dir {
        dst.push(file_name(src)?);
    }
    let bar = Bar::bytes(&name_of(&dst), meta.len());
    client
        .write_file_from(
            &dst,
            meta.permissions().mode() & 0o7777,
            &mut bar.inner().wrap_read(file),
        )
        .with_context(|| format!("write {} in the guest", dst.display()))?;
    bar.finish();
    Ok(())
}

fn download(client: &Client, src: &Path, dst: &Path) -> anyhow::Result<()> {
    let stat = client
        .stat(src)
        .with_context(|| format!("{} in the guest", src.display()))?;
    if stat.kind == FileKind::Dir {
        bail!("{}: copying directories is not supported", src.display());
    }
    if dst == Path::new("-") {
        let mut out = io::stdout().lock();
        client.read_file_to(src, &mut out)?;
        out.flush()?;
        return Ok(());
    }
    let mut dst = dst.to_path_buf();
    if dst.as_os_str().as_encoded_bytes().ends_with(b"/") || dst.is_dir() {
        dst.push(file_name(src)?);
    }
    let file = File::create(&dst).with_context(|| format!("create {}", dst.display()))?;
    let bar = Bar::bytes(&name_of(src), stat.size);
    let mut file = bar.inner().wrap_write(file);
    client
        .read_file_to(src, &mut file)
        .with_context(|| format!("read {} from the guest", src.display()))?;
    file.flush()?;
    bar.finish();
    fs::set_permissions(&dst, fs::Permissions::from_mode(stat.mode & 0o7777))
        .with_context(|| format!("chmod {}", dst.display()))?;
    Ok(())
}

/// A path's file name, for a progress bar.
fn name_of(p: &Path) -> String {
    p.file_name()
        .unwrap_or(p.as_os_str())
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn locations_need_an_existing_socket() {
        let dir = std::env::temp_dir().join(format!("clade-cp-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("vm.sock");
        let _l = UnixListener::bind(&sock).unwrap();
        let s = sock.to_str().unwrap();
        assert_eq!(
            parse_location(&format!("{s}:/etc/hostname")),
            Location::Guest {
                socket: sock.clone(),
                path: "/etc/hostname".into()
            }
        );
        // A path with a colon whose prefix is not a socket stays on the host.
        assert_eq!(
            parse_location("/tmp/a:b"),
            Location::Host("/tmp/a:b".into())
        );
        assert_eq!(
            parse_location(&format!("{s}:")),
            Location::Host(format!("{s}:").into())
        );
        assert_eq!(parse_location("-"), Location::Host("-".into()));
        fs::remove_dir_all(&dir).unwrap();
    }
}
