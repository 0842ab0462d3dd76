//! `clade disk`: create, inspect, freeze and flatten layered disk images (`disk` crate;
//! format in `disk/FORMAT.md`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use disk::ops::{self, CreateOptions, FlattenFormat};

#[derive(Debug, Subcommand)]
pub enum DiskCommand {
    /// Create a layer: a blank disk (--size), an overlay on a frozen layer (--parent), or a
    /// frozen base imported from a raw image (--from).
    Create(CreateArgs),
    /// Check a layer and its whole parent chain; print each layer, top first.
    Info {
        /// The top layer.
        file: PathBuf,
        /// One JSON object per layer instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Merge a chain into one standalone image with the same content (a new frozen base,
    /// or with --raw a raw sparse image).
    Flatten {
        /// The chain's top layer.
        top: PathBuf,
        /// Output file (must not exist).
        out: PathBuf,
        /// Write a raw image instead of a layer.
        #[arg(long)]
        raw: bool,
    },
    /// Freeze a layer no VM uses: it becomes read-only and can be a parent.
    Freeze {
        /// The layer.
        file: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Output file (must not exist).
    out: PathBuf,
    /// Virtual size of a blank disk: bytes, or with a suffix (K, M, G, T; powers of 1024).
    #[arg(long, value_parser = parse_size, conflicts_with_all = ["parent", "from"])]
    size: Option<u64>,
    /// Make an overlay on this frozen layer (same size and block size).
    #[arg(long, conflicts_with = "from")]
    parent: Option<PathBuf>,
    /// Import this raw image (file or block device) as a frozen base layer.
    #[arg(long)]
    from: Option<PathBuf>,
    /// Block size in bytes (power of two, 4K..2M; default 64K).
    #[arg(long, value_parser = parse_block_size, conflicts_with = "parent")]
    block_size: Option<u32>,
}

/// Parses "4096", "64K", "512M", "10G", "1T" into bytes.
pub(super) fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let digits = upper.trim_end_matches(['B', 'I']);
    let (num, shift) = match digits.chars().last() {
        Some('K') => (&digits[..digits.len() - 1], 10),
        Some('M') => (&digits[..digits.len() - 1], 20),
        Some('G') => (&digits[..digits.len() - 1], 30),
        Some('T') => (&digits[..digits.len() - 1], 40),
        _ => (digits, 0),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| format!("'{s}' is not a size (examples: 4096, 64K, 512M, 10G)"))
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    let n = parse_size(s)?;
    u32::try_from(n).map_err(|_| format!("block size {s} is too large"))
}

pub fn disk(cmd: DiskCommand) -> anyhow::Result<u8> {
    match cmd {
        DiskCommand::Create(a) => create(a),
        DiskCommand::Info { file, json } => info(&file, json),
        DiskCommand::Flatten { top, out, raw } => {
            let format = if raw {
                FlattenFormat::Raw
            } else {
                FlattenFormat::Layer
            };
            let s = ops::flatten(&top, &out, format)?;
            println!(
                "{}: {} bytes, {} of {} blocks stored{}",
                out.display(),
                s.virtual_size,
                s.stored,
                s.blocks,
                if raw { " (raw)" } else { ", frozen" }
            );
            Ok(0)
        }
        DiskCommand::Freeze { file } => {
            ops::freeze(&file)?;
            println!("{}: frozen", file.display());
            Ok(0)
        }
    }
}

fn create(a: CreateArgs) -> anyhow::Result<u8> {
    if let Some(raw) = &a.from {
        let s = ops::import_raw(raw, &a.out, a.block_size)
            .with_context(|| format!("importing {}", raw.display()))?;
        println!(
            "{}: frozen base, {} bytes, {} of {} blocks stored",
            a.out.display(),
            s.virtual_size,
            s.stored,
            s.blocks
        );
        return Ok(0);
    }
    if a.size.is_none() && a.parent.is_none() {
        anyhow::bail!("clade disk create needs --size, --parent or --from");
    }
    let h = ops::create(
        &a.out,
        &CreateOptions {
            virtual_size: a.size,
            block_size: a.block_size,
            parent: a.parent.clone(),
        },
    )?;
    match &a.parent {
        Some(p) => println!(
            "{}: overlay on {}, {} bytes",
            a.out.display(),
            p.display(),
            h.virtual_size
        ),
        None => println!("{}: blank disk, {} bytes", a.out.display(), h.virtual_size),
    }
    Ok(0)
}

fn info(file: &std::path::Path, json: bool) -> anyhow::Result<u8> {
    let layers = ops::info(file)?;
    for (depth, l) in layers.iter().enumerate() {
        let h = &l.header;
        if json {
            let v = serde_json::json!({
                "depth": depth,
                "path": l.path,
                "id": disk::id_hex(&h.layer_id),
                "frozen": h.frozen(),
                "virtual_size": h.virtual_size,
                "block_size": h.block_size,
                "allocated_blocks": l.allocated_blocks,
                "file_size": l.file_len,
                "parent": h.parent.as_ref().map(|p| serde_json::json!({
                    "path": p.path,
                    "id": disk::id_hex(&p.id),
                })),
            });
            println!("{v}");
        } else {
            println!(
                "{}{} id={} {} size={} block={} allocated={} blocks ({} bytes) file={} bytes{}",
                "  ".repeat(depth),
                l.path.display(),
                disk::id_hex(&h.layer_id),
                if h.frozen() { "frozen" } else { "writable" },
                h.virtual_size,
                h.block_size,
                l.allocated_blocks,
                l.allocated_blocks * u64::from(h.block_size),
                l.file_len,
                h.parent
                    .as_ref()
                    .map(|p| format!(" parent={}", p.path.display()))
                    .unwrap_or_default()
            );
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("10GiB"), Ok(10 << 30));
        assert_eq!(parse_size("1t"), Ok(1 << 40));
        assert!(parse_size("big").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert!(parse_block_size("8G").is_err());
    }
}
