//! docs/cli.md is the CLI reference: for `clade` and every subcommand it holds the exact
//! `--help` text in a fenced block, and its example command lines (and the README's) use
//! only options the commands have. This test keeps it so.
//!
//! Regenerate the help blocks after a change to the CLI:
//!
//!     CLADE_UPDATE_CLI_DOC=1 cargo test -p clade --test cli_doc
//!
//! A block is a fence opened by "```text" whose first line is `$ clade ... --help`. The
//! commands are found from `clade --help` itself (its "Commands:" lists, recursively), so a
//! new subcommand without a block fails here. The help is taken with every `CLADE_*`
//! variable removed from the environment: clap shows a set variable's value next to its
//! option (`[env: CLADE_STORE=...]`), which would make the text depend on the machine.
//! Trailing spaces at line ends are not compared (clap prints some; editors drop them).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const UPDATE_VAR: &str = "CLADE_UPDATE_CLI_DOC";
const REGENERATE: &str = "CLADE_UPDATE_CLI_DOC=1 cargo test -p clade --test cli_doc";

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// `clade PATH... --help`, as a user with no `CLADE_*` variable set sees it.
fn help(path: &[String]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_clade"));
    cmd.args(path).arg("--help");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("CLADE_") {
            cmd.env_remove(&name);
        }
    }
    // The help is not wrapped today; if clap's `wrap_help` is ever turned on, a pipe then
    // gets its fixed default width rather than whatever COLUMNS this shell has.
    cmd.env_remove("COLUMNS");
    let out = cmd.output().expect("running clade --help");
    assert!(
        out.status.success(),
        "`clade {} --help` failed: {}",
        path.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    normalize(&String::from_utf8(out.stdout).expect("help is UTF-8"))
}

/// Each line without its trailing spaces; the text ends with exactly one newline.
fn normalize(text: &str) -> String {
    let mut s: String = text
        .lines()
        .map(|l| l.trim_end().to_string() + "\n")
        .collect();
    while s.ends_with("\n\n") {
        s.pop();
    }
    s
}

/// The subcommands a help text lists under "Commands:" (`help` left out).
fn subcommands(help: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_list = false;
    for line in help.lines() {
        if line == "Commands:" {
            in_list = true;
            continue;
        }
        if !in_list {
            continue;
        }
        if line.trim().is_empty() || !line.starts_with("  ") {
            in_list = false;
            continue;
        }
        // "  name  description": a name starts right after the two spaces.
        if let Some(name) = line
            .strip_prefix("  ")
            .and_then(|l| l.split_whitespace().next())
        {
            if !line[2..].starts_with(' ') && name != "help" {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// Every command path (`[]` is `clade` itself) with its help, found from `clade --help`.
fn command_tree() -> BTreeMap<Vec<String>, String> {
    let mut tree = BTreeMap::new();
    let mut todo = vec![Vec::<String>::new()];
    while let Some(path) = todo.pop() {
        let text = help(&path);
        for sub in subcommands(&text) {
            let mut child = path.clone();
            child.push(sub);
            todo.push(child);
        }
        tree.insert(path, text);
    }
    tree
}

fn prompt(path: &[String]) -> String {
    let mut p = String::from("$ clade");
    for w in path {
        p.push(' ');
        p.push_str(w);
    }
    p + " --help"
}

/// A help block found in the document: its command, the byte range of the whole fence
/// (its opening line to its closing line, included), of its body (after the prompt line,
/// up to the closing fence) and the body's text.
struct Block {
    path: Vec<String>,
    fence: std::ops::Range<usize>,
    body: std::ops::Range<usize>,
    text: String,
}

fn help_blocks(doc: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    // Every line with its byte offset.
    let mut lines = Vec::new();
    let mut offset = 0;
    for line in doc.split_inclusive('\n') {
        lines.push((offset, line));
        offset += line.len();
    }
    let mut i = 0;
    while i < lines.len() {
        let (fence_start, line) = lines[i];
        i += 1;
        if line.trim_end() != "```text" || i >= lines.len() {
            continue;
        }
        let Some(rest) = lines[i]
            .1
            .trim_end()
            .strip_prefix("$ clade")
            .and_then(|r| r.strip_suffix("--help"))
        else {
            continue;
        };
        let path: Vec<String> = rest.split_whitespace().map(str::to_string).collect();
        i += 1;
        let start = lines.get(i).map_or(doc.len(), |l| l.0);
        let (mut end, mut fence_end) = (doc.len(), doc.len());
        while i < lines.len() {
            let (at, body_line) = lines[i];
            i += 1;
            if body_line.trim_end() == "```" {
                end = at;
                fence_end = at + body_line.len();
                break;
            }
        }
        blocks.push(Block {
            path,
            fence: fence_start..fence_end,
            body: start..end,
            text: doc[start..end].to_string(),
        });
    }
    blocks
}

fn name(path: &[String]) -> String {
    if path.is_empty() {
        "clade".to_string()
    } else {
        format!("clade {}", path.join(" "))
    }
}

/// Rewrites every block with the binary's help, drops blocks of commands that no longer
/// exist and appends a section for each command that has none. Returns the new text and
/// what a person still has to do.
fn update(doc: &str, tree: &BTreeMap<Vec<String>, String>) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut notes = Vec::new();
    let mut last = 0;
    let mut seen = Vec::new();
    for b in help_blocks(doc) {
        if let Some(text) = tree.get(&b.path) {
            out.push_str(&doc[last..b.body.start]);
            out.push_str(text);
            last = b.body.end;
            seen.push(b.path);
        } else {
            // The fence goes; its heading and prose are left for a person to remove.
            out.push_str(&doc[last..b.fence.start]);
            last = b.fence.end;
            notes.push(format!(
                "removed the help block of `{}` (no such command): remove its heading and \
                 prose by hand",
                name(&b.path)
            ));
        }
    }
    out.push_str(&doc[last..]);
    for (path, text) in tree {
        if !seen.contains(path) {
            if !out.ends_with("\n\n") {
                out.push('\n');
            }
            out.push_str(&format!(
                "## `{}`\n\n```text\n{}\n{}```\n",
                name(path),
                prompt(path),
                text
            ));
            notes.push(format!(
                "added a section for `{}` at the end: move it where it belongs",
                name(path)
            ));
        }
    }
    (out, notes)
}

#[test]
fn docs_cli_md_holds_every_commands_help_as_the_binary_prints_it() {
    let doc_path = repo_file("docs/cli.md");
    let tree = command_tree();
    let mut doc = std::fs::read_to_string(&doc_path).expect("reading docs/cli.md");
    if std::env::var_os(UPDATE_VAR).is_some_and(|v| v == "1") {
        let (new, notes) = update(&doc, &tree);
        for note in notes {
            eprintln!("docs/cli.md: {note}");
        }
        if new != doc {
            std::fs::write(&doc_path, &new).expect("writing docs/cli.md");
            eprintln!("docs/cli.md: help blocks rewritten from the binary");
        }
        doc = new;
    }

    let blocks = help_blocks(&doc);
    let mut problems = Vec::new();
    for (path, text) in &tree {
        let found: Vec<&Block> = blocks.iter().filter(|b| &b.path == path).collect();
        match found.as_slice() {
            [] => problems.push(format!(
                "`{}` exists but docs/cli.md has no block for it",
                name(path)
            )),
            [b] if normalize(&b.text) != *text => problems.push(format!(
                "the help of `{}` in docs/cli.md differs from the binary's:\n{}",
                name(path),
                first_difference(&normalize(&b.text), text)
            )),
            [_] => {}
            _ => problems.push(format!(
                "docs/cli.md has {} help blocks for `{}`: keep one",
                found.len(),
                name(path)
            )),
        }
    }
    for b in &blocks {
        if !tree.contains_key(&b.path) {
            problems.push(format!(
                "docs/cli.md has a help block for `{}`, which is no command (`clade --help` \
                 does not list it)",
                name(&b.path)
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/cli.md does not match `clade --help`:\n- {}\n\nRegenerate the help blocks with:\n    {REGENERATE}\n",
        problems.join("\n- ")
    );
}

/// The first line where the documented help and the binary's part, with both lines.
fn first_difference(documented: &str, actual: &str) -> String {
    let (d, a): (Vec<&str>, Vec<&str>) = (documented.lines().collect(), actual.lines().collect());
    for i in 0..d.len().max(a.len()) {
        let (dl, al) = (d.get(i), a.get(i));
        if dl != al {
            return format!(
                "  line {}:\n    docs/cli.md: {}\n    clade:       {}",
                i + 1,
                dl.map_or("(nothing)".to_string(), |l| format!("{l:?}")),
                al.map_or("(nothing)".to_string(), |l| format!("{l:?}"))
            );
        }
    }
    "  (only in line endings)".to_string()
}

/// The long options (`--name`) a help text offers.
fn long_options(help: &str) -> Vec<String> {
    let mut opts = Vec::new();
    let bytes = help.as_bytes();
    let mut i = 0;
    while let Some(at) = help[i..].find("--") {
        let start = i + at + 2;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'-') {
            end += 1;
        }
        if end > start {
            opts.push(help[start..end].to_string());
        }
        i = end.max(start);
    }
    opts
}

/// The command lines of the ```sh blocks of a Markdown text: each a line that runs
/// `clade` (after `VAR=value` words and `sudo`), with the indented lines under it that
/// continue it, comments (` #`) removed; several commands on one line split at `;` and
/// `&&`. Returns (line number, the words after `clade`).
fn documented_command_lines(doc: &str) -> Vec<(usize, Vec<String>)> {
    let mut found: Vec<(usize, Vec<String>)> = Vec::new();
    let mut in_sh = false;
    let mut current: Option<usize> = None;
    for (n, raw) in doc.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with("```") {
            in_sh = !in_sh && (trimmed == "```sh" || trimmed == "```bash");
            current = None;
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = match raw.find(" #") {
            Some(i) => &raw[..i],
            None if raw.trim_start().starts_with('#') => "",
            None => raw,
        };
        if raw.starts_with(' ') || raw.starts_with('\t') {
            // A continuation of the command above it, if any.
            if let Some(k) = current {
                found[k]
                    .1
                    .extend(code.split_whitespace().map(str::to_string));
            }
            continue;
        }
        current = None;
        for part in code.split(';').flat_map(|p| p.split("&&")) {
            let mut words = part.split_whitespace().skip_while(|w| {
                *w == "sudo" || (w.contains('=') && !w.starts_with('-') && !w.contains('/'))
            });
            let Some(first) = words.next() else { continue };
            if first == "clade" || first.ends_with("/clade") {
                found.push((n + 1, words.map(str::to_string).collect()));
                current = Some(found.len() - 1);
            }
        }
    }
    found
}

#[test]
fn documented_command_lines_use_commands_and_options_that_exist() {
    let tree = command_tree();
    let mut problems = Vec::new();
    for file in ["README.md", "docs/cli.md", "docs/testing.md"] {
        let Ok(doc) = std::fs::read_to_string(repo_file(file)) else {
            continue;
        };
        for (line, words) in documented_command_lines(&doc) {
            // The command path: the words that name subcommands, from the start.
            let mut path: Vec<String> = Vec::new();
            for w in &words {
                let mut next = path.clone();
                next.push(w.clone());
                if tree.contains_key(&next) {
                    path = next;
                } else {
                    break;
                }
            }
            let shown = format!("{file}:{line}: clade {}", words.join(" "));
            if path.is_empty() && !words.iter().all(|w| w.starts_with('-')) {
                problems.push(format!("{shown}\n    `{}` is no command", words[0]));
                continue;
            }
            let offered = long_options(&tree[&path]);
            // Words after a bare `--` are the guest's command, not clade's.
            for w in words.iter().take_while(|w| *w != "--") {
                for opt in long_options(w) {
                    if !offered.contains(&opt) {
                        problems.push(format!(
                            "{shown}\n    `{}` has no option --{opt}",
                            name(&path)
                        ));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "command lines in the docs that the CLI would refuse:\n- {}\n",
        problems.join("\n- ")
    );
}

#[test]
fn the_parsers_read_what_they_are_given() {
    let help = "About\n\nUsage: clade <COMMAND>\n\nCommands:\n  run   Boot\n  \
                fork-processes  Fork\n  help  Print\n\nOptions:\n  -h, --help  Print help\n";
    assert_eq!(subcommands(help), ["run", "fork-processes"]);
    assert_eq!(normalize("a  \n\nb\n\n\n"), "a\n\nb\n");
    let doc = "x\n```text\n$ clade run --help\nold\n```\ny\n```text\n$ clade gone --help\nz\n```\n";
    let blocks = help_blocks(doc);
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0].path, ["run"]);
    assert_eq!(blocks[0].text, "old\n");
    let mut tree = BTreeMap::new();
    tree.insert(vec!["run".to_string()], "new\n".to_string());
    tree.insert(vec![], "top\n".to_string());
    let (updated, notes) = update(doc, &tree);
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(updated.starts_with("x\n```text\n$ clade run --help\nnew\n```\ny\n"));
    assert!(!updated.contains("gone"), "{updated}");
    assert!(updated.ends_with("## `clade`\n\n```text\n$ clade --help\ntop\n```\n"));
    let sh = "```sh\nCLADE_API_KEY=K clade serve --listen A # --nothing\n    [--store URL]\n\
              clade ping S ; clade poweroff S\n```\n```sh\n  clade not-continued\n```\n";
    let lines = documented_command_lines(sh);
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[0].1, ["serve", "--listen", "A", "[--store", "URL]"]);
    assert_eq!(lines[2].1, ["poweroff", "S"]);
    assert_eq!(
        long_options("[--no-jail|--jail-uids=1]"),
        ["no-jail", "jail-uids"]
    );
}
