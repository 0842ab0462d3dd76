//! The house rules a newcomer relies on, checked so that they hold: no source file over
//! [`MAX_LINES`] lines of code before its tests, no `impl` block over [`MAX_METHODS`]
//! functions, and every module opening with a `//!` comment that says what it owns.
//! Test code (files under `tests/`, `tests.rs` modules, `#[cfg(test)]` tails) is not
//! counted: long tests read as a list.

use std::path::{Path, PathBuf};

/// Lines of a source file before its `#[cfg(test)]` module.
const MAX_LINES: usize = 1000;
/// Functions in one `impl` block.
const MAX_METHODS: usize = 40;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Every non-test `.rs` file of the workspace's crates.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(ty) = e.file_type() else { continue };
        if ty.is_dir() {
            // Build outputs, and test code (integration tests, the test guests and
            // servers under tests/).
            if !matches!(
                name.as_str(),
                "target" | "build" | "tests" | "node_modules" | ".git"
            ) && !name.starts_with('.')
            {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// The lines of `text` before its test module.
fn code_lines(text: &str) -> Vec<&str> {
    text.lines()
        .take_while(|l| !l.starts_with("#[cfg(test)]"))
        .collect()
}

/// Each top-level `impl` block's first line (1-based) and how many functions it has.
fn impl_sizes(lines: &[&str]) -> Vec<(usize, usize)> {
    let mut sizes = Vec::new();
    let mut open: Option<(usize, usize)> = None;
    for (i, l) in lines.iter().enumerate() {
        if let Some((start, n)) = open {
            if l.starts_with('}') {
                sizes.push((start, n));
                open = None;
            } else if is_fn(l) {
                open = Some((start, n + 1));
            }
        } else if (l.starts_with("impl ") || l.starts_with("impl<")) && l.ends_with('{') {
            open = Some((i + 1, 0));
        }
    }
    sizes
}

/// A function item at the first indent of an impl block.
fn is_fn(line: &str) -> bool {
    let Some(rest) = line.strip_prefix("    ") else {
        return false;
    };
    if rest.starts_with(' ') {
        return false;
    }
    let mut rest = rest;
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
    ] {
        if let Some(r) = rest.strip_prefix(prefix) {
            rest = r;
        }
    }
    rest.starts_with("fn ")
}

#[test]
fn source_files_and_impls_stay_small_and_say_what_they_own() {
    let root = repo_root();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&root).expect("the repository").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().join("Cargo.toml").is_file() && name != "tests" {
            sources(&entry.path(), &mut files);
        }
    }
    // The test crate's own library (tests/src) is project code too.
    sources(&root.join("tests/src"), &mut files);
    assert!(files.len() > 100, "only {} source files found", files.len());
    let mut problems = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("a source file");
        let rel = f.strip_prefix(&root).unwrap_or(f).display().to_string();
        let lines = code_lines(&text);
        if lines.len() > MAX_LINES {
            problems.push(format!(
                "{rel}: {} lines before its tests (at most {MAX_LINES}): split it by concern",
                lines.len()
            ));
        }
        for (at, n) in impl_sizes(&lines) {
            if n > MAX_METHODS {
                problems.push(format!(
                    "{rel}:{at}: an impl with {n} functions (at most {MAX_METHODS})"
                ));
            }
        }
        if !text.trim_start().starts_with("//!") {
            problems.push(format!(
                "{rel}: no `//!` comment first, saying what the module owns"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_counting_sees_what_it_counts() {
    let text = "//! m\nimpl A {\n    pub fn a() {}\n    fn b() {\n        fn inner() {}\n    }\n    pub(crate) const fn c() {}\n}\n#[cfg(test)]\nmod tests {}\n";
    let lines = code_lines(text);
    assert_eq!(lines.len(), 8);
    assert_eq!(impl_sizes(&lines), vec![(2, 3)]);
}
