//! A sandbox's log lines, for E2B's `GET /sandboxes/{id}/logs`: the VMM's log (`vm.log`,
//! the VM process's stderr, appended by every run) and the guest's serial console of each
//! run (`serial-r<k>.log`), read from the files the VM processes write.
//!
//! Bounded: only the last [`TAIL_BYTES`] of each file are read, a line is cut at
//! [`MAX_LINE`] bytes, and at most [`MAX_LOG_LINES`] lines (the newest) are returned. The
//! guest writes the console, so its bytes are untrusted: invalid UTF-8 is replaced, control
//! characters are dropped.
//!
//! Times: a VMM log line starts with its RFC 3339 time (the `tracing` format); console lines
//! carry none, so they get the time their file was last written.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use crate::ids;

/// Bytes read from the end of each log file.
pub const TAIL_BYTES: u64 = 256 * 1024;
/// Longest line kept (longer ones are cut).
pub const MAX_LINE: usize = 4096;
/// Most lines returned.
pub const MAX_LOG_LINES: usize = 4000;

/// One log line.
#[derive(Debug, Clone, PartialEq)]
pub struct LogLine {
    /// When (ms since the epoch).
    pub at_ms: i64,
    /// `debug`, `info`, `warn` or `error` (E2B's levels).
    pub level: &'static str,
    /// Which file: `vmm` or `console`.
    pub source: &'static str,
    /// The text, without its time and level.
    pub text: String,
}

/// The lines of the sandbox directory `dir`, oldest first.
pub fn read(dir: &Path) -> Vec<LogLine> {
    let mut out = Vec::new();
    let vm = dir.join("vm.log");
    if let Some((text, mtime)) = tail(&vm) {
        out.extend(text.lines().map(|l| vmm_line(l, mtime)));
    }
    // Console files in run order.
    let mut consoles: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let k = name.strip_prefix("serial-r")?.strip_suffix(".log")?;
            Some((k.parse().ok()?, e.path()))
        })
        .collect();
    consoles.sort();
    for (_, path) in consoles {
        if let Some((text, mtime)) = tail(&path) {
            out.extend(
                text.lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| LogLine {
                        at_ms: mtime,
                        level: "info",
                        source: "console",
                        text: clean(l),
                    }),
            );
        }
    }
    // Stable: lines of one time keep their file order.
    out.sort_by_key(|l| l.at_ms);
    if out.len() > MAX_LOG_LINES {
        out.drain(..out.len() - MAX_LOG_LINES);
    }
    out
}

/// The last [`TAIL_BYTES`] of `path` (from the first whole line) and its modification time.
fn tail(path: &Path) -> Option<(String, i64)> {
    let mut f = std::fs::File::open(path).ok()?;
    let meta = f.metadata().ok()?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as i64)
        .unwrap_or_else(ids::now_ms);
    let start = meta.len().saturating_sub(TAIL_BYTES);
    f.seek(SeekFrom::Start(start)).ok()?;
    let mut bytes = Vec::new();
    f.take(TAIL_BYTES).read_to_end(&mut bytes).ok()?;
    if start > 0 {
        // Started inside a line: drop that part.
        let cut = bytes
            .iter()
            .position(|b| *b == b'\n')
            .map_or(bytes.len(), |i| i + 1);
        bytes.drain(..cut);
    }
    Some((String::from_utf8_lossy(&bytes).into_owned(), mtime))
}

/// A line without terminal escape sequences and control characters, cut at [`MAX_LINE`].
fn clean(line: &str) -> String {
    let mut out = String::with_capacity(line.len().min(MAX_LINE));
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte (colours from the log formatter).
            if chars.peek() == Some(&'[') {
                chars.next();
                for d in chars.by_ref() {
                    if ('@'..='~').contains(&d) {
                        break;
                    }
                }
            }
            continue;
        }
        if c.is_control() && c != '\t' {
            continue;
        }
        if out.len() + c.len_utf8() > MAX_LINE {
            break;
        }
        out.push(c);
    }
    out
}

/// A VMM log line: `TIME LEVEL target: message` when the `tracing` formatter wrote it, else
/// the whole line (`clade: …` is a fatal error's report).
fn vmm_line(raw: &str, mtime: i64) -> LogLine {
    let line = clean(raw);
    let mut words = line.trim_start().splitn(2, char::is_whitespace);
    let first = words.next().unwrap_or("");
    let rest = words.next().unwrap_or("").trim_start();
    if let Some(at_ms) = ids::parse_rfc3339(first) {
        let mut words = rest.splitn(2, char::is_whitespace);
        let level = match words.next().unwrap_or("") {
            "ERROR" => Some("error"),
            "WARN" => Some("warn"),
            "INFO" => Some("info"),
            "DEBUG" | "TRACE" => Some("debug"),
            _ => None,
        };
        if let Some(level) = level {
            return LogLine {
                at_ms,
                level,
                source: "vmm",
                text: words.next().unwrap_or("").trim_start().to_string(),
            };
        }
        return LogLine {
            at_ms,
            level: "info",
            source: "vmm",
            text: rest.to_string(),
        };
    }
    LogLine {
        at_ms: mtime,
        level: if line.starts_with("clade:") {
            "error"
        } else {
            "info"
        },
        source: "vmm",
        text: line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmm_and_console_lines_are_parsed_bounded_and_cleaned() {
        let d = std::env::temp_dir().join(format!("sandbox-logs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("vm.log"),
            "2024-05-01T10:00:00.000000Z \u{1b}[33m WARN\u{1b}[0m vmm::vm: slow\n\
             clade: restore failed\n",
        )
        .unwrap();
        std::fs::write(d.join("serial-r0.log"), "boot\x07 ok\n\n").unwrap();
        std::fs::write(d.join("serial-r1.log"), "x".repeat(MAX_LINE * 2) + "\n").unwrap();
        let lines = read(&d);
        assert_eq!(lines.len(), 4, "{lines:?}");
        assert_eq!(lines[0].at_ms, 1_714_557_600_000);
        assert_eq!((lines[0].level, lines[0].source), ("warn", "vmm"));
        assert_eq!(lines[0].text, "vmm::vm: slow");
        let err = lines.iter().find(|l| l.text.starts_with("clade:")).unwrap();
        assert_eq!(err.level, "error");
        let console: Vec<_> = lines.iter().filter(|l| l.source == "console").collect();
        assert_eq!(console[0].text, "boot ok");
        assert_eq!(console[1].text.len(), MAX_LINE);

        // A huge file: only its tail is read, from a whole line on.
        let big: String = (0..100_000).map(|i| format!("line {i}\n")).collect();
        std::fs::write(d.join("serial-r0.log"), big).unwrap();
        let lines = read(&d);
        assert!(lines.len() <= MAX_LOG_LINES);
        let last = lines.iter().rev().find(|l| l.source == "console").unwrap();
        assert!(
            last.text.starts_with("line 99999") || lines.iter().any(|l| l.text == "line 99999")
        );
        assert!(lines
            .iter()
            .all(|l| l.text.starts_with("line ") || l.source == "vmm"));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
