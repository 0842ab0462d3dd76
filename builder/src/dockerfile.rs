//! Dockerfiles: parsed into instructions ([`parse`]), then evaluated against the base
//! image's defaults and the build arguments into a [`Plan`] ([`Parsed::plan`]): the steps
//! that change the disk (RUN, COPY/ADD), each with the environment, working directory and
//! user it runs with, and the defaults the template keeps (ENV, WORKDIR, USER, CMD,
//! ENTRYPOINT).
//!
//! Our own parser, because the Dockerfile crates on crates.io are unmaintained: the
//! classic syntax (one instruction per logical line, `\` continuations, `#` comments, JSON
//! or shell form, `$VAR`/`${VAR}`/`${VAR:-default}`/`${VAR:+alt}` substitution in the
//! instructions Docker substitutes in). A Dockerfile is input from a user or a tenant:
//! anything this parser does not handle exactly is refused with the line it is on,
//! never approximated (multi-stage builds, `COPY --from`, `ADD` of a URL or an archive,
//! `RUN --mount`, heredocs, `ONBUILD`, another escape character).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use clade_image::ImageDefaults;

/// The largest Dockerfile read (bytes).
pub const MAX_DOCKERFILE: usize = 1 << 20;
/// Most instructions in one Dockerfile.
pub const MAX_INSTRUCTIONS: usize = 1000;
/// The shell RUN and shell-form CMD/ENTRYPOINT use unless SHELL says otherwise.
const DEFAULT_SHELL: [&str; 2] = ["/bin/sh", "-c"];

/// A command as written: shell form (a string for the shell) or exec form (a JSON array).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandForm {
    /// `RUN make all`.
    Shell(String),
    /// `RUN ["make", "all"]`.
    Exec(Vec<String>),
}

/// One instruction as written (arguments not yet substituted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Instruction {
    /// `FROM image` (its `--platform`, if any, was linux/amd64).
    From(String),
    /// `RUN`.
    Run(CommandForm),
    /// `COPY` (or `ADD` of files from the context).
    Copy {
        /// Sources then the destination (unsubstituted).
        args: CommandForm,
        /// `--chown=user[:group]`.
        chown: Option<String>,
        /// `--chmod=octal`.
        chmod: Option<String>,
        /// It was written ADD.
        add: bool,
    },
    /// `ENV` pairs (unsubstituted words).
    Env(Vec<String>),
    /// `ARG name[=default]` (unsubstituted).
    Arg(Vec<String>),
    /// `WORKDIR`.
    Workdir(String),
    /// `USER`.
    User(String),
    /// `CMD`.
    Cmd(CommandForm),
    /// `ENTRYPOINT`.
    Entrypoint(CommandForm),
    /// `SHELL ["executable", "parameters"]`.
    Shell(Vec<String>),
    /// An instruction that changes nothing a sandbox has (LABEL, EXPOSE, MAINTAINER,
    /// STOPSIGNAL, VOLUME, HEALTHCHECK): kept so the plan can say it was ignored.
    Ignored(String),
}

/// An instruction and the line it starts on (1-based).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// The line number.
    pub line: usize,
    /// The instruction as written (continuations joined), for logs.
    pub text: String,
    /// What it says.
    pub instruction: Instruction,
}

/// A parsed Dockerfile: the ARGs before its FROM, the FROM, and what follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// `ARG`s before the FROM (usable in the FROM line only, unless declared again).
    pub global_args: Vec<Line>,
    /// The FROM line.
    pub from: Line,
    /// The instructions after it.
    pub body: Vec<Line>,
}

/// What a step does to the disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Action {
    /// Run `argv` (no shell unless argv names one).
    Run {
        /// The program and its arguments.
        argv: Vec<String>,
    },
    /// Copy files of the build context.
    Copy {
        /// Sources relative to the context, each normalised: no `..`, no leading `/`
        /// (`"."` for the context itself); they may hold glob characters.
        srcs: Vec<String>,
        /// The absolute destination; a trailing `/` means a directory.
        dest: String,
        /// Owner to give what is copied (`user[:group]`, names or ids).
        chown: Option<String>,
        /// Mode to give what is copied.
        chmod: Option<u32>,
    },
}

/// One step that changes the disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// The Dockerfile line it comes from.
    pub line: usize,
    /// The instruction as written.
    pub text: String,
    /// What it does.
    pub action: Action,
    /// The environment it runs with (the image's and ENV's, then ARGs in scope).
    pub env: Vec<(String, String)>,
    /// The working directory ("" : `/`).
    pub cwd: String,
    /// The user ("" : root).
    pub user: String,
    /// Run it even if it is cached (and every step after it).
    #[serde(default, skip)]
    pub force: bool,
}

/// What a Dockerfile asks for, evaluated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The base image (substituted).
    pub from: String,
    /// The steps that change the disk, in order.
    pub steps: Vec<Step>,
    /// The defaults the result keeps: the base image's, changed by ENV, WORKDIR, USER,
    /// CMD and ENTRYPOINT.
    pub defaults: ImageDefaults,
    /// Instructions that were ignored, with their lines (said in the build's output).
    pub ignored: Vec<String>,
    /// Build arguments given that no ARG declared.
    pub unused_args: Vec<String>,
}

fn bad(line: usize, msg: impl Into<String>) -> Error {
    Error::Dockerfile {
        line,
        msg: msg.into(),
    }
}

/// Logical lines: `(first line number, text)`, continuations joined, comments and blank
/// lines dropped.
fn logical_lines(text: &str) -> Result<Vec<(usize, String)>> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    let mut directives = true;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = raw.trim_start();
        if let Some(comment) = trimmed.strip_prefix('#') {
            // Parser directives: only at the very top, before anything else.
            if directives && cur.is_none() {
                let d = comment.trim();
                if let Some((k, v)) = d.split_once('=') {
                    let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                    if k == "escape" && v != "\\" {
                        return Err(bad(
                            n,
                            format!("escape character '{v}' is not supported (only '\\')"),
                        ));
                    }
                    if k == "escape" || k == "syntax" || k == "check" {
                        continue;
                    }
                }
            }
            directives = false;
            continue;
        }
        directives = false;
        if trimmed.is_empty() {
            continue;
        }
        let body = raw.trim_end();
        let (part, continues) = match body.strip_suffix('\\') {
            Some(p) => (p, true),
            None => (body, false),
        };
        match &mut cur {
            Some((_, s)) => s.push_str(part),
            None => cur = Some((n, part.trim_start().to_string())),
        }
        if !continues {
            out.push(cur.take().expect("set above"));
        }
    }
    if let Some((n, s)) = cur {
        // A continuation at the end of the file ends the instruction.
        out.push((n, s));
    }
    Ok(out)
}

/// Splits leading `--name=value` flags off `args`.
fn flags(line: usize, args: &str) -> Result<(Vec<(String, String)>, &str)> {
    let mut rest = args.trim_start();
    let mut out = Vec::new();
    while let Some(f) = rest.strip_prefix("--") {
        let end = f.find(char::is_whitespace).unwrap_or(f.len());
        let (flag, after) = f.split_at(end);
        let (k, v) = match flag.split_once('=') {
            Some((k, v)) => (k, v),
            None => (flag, ""),
        };
        if k.is_empty() {
            return Err(bad(line, "an empty flag '--'"));
        }
        out.push((k.to_ascii_lowercase(), v.to_string()));
        rest = after.trim_start();
    }
    Ok((out, rest))
}

fn command_form(args: &str) -> CommandForm {
    let t = args.trim();
    if t.starts_with('[') {
        if let Ok(v) = serde_json::from_str::<Vec<String>>(t) {
            return CommandForm::Exec(v);
        }
    }
    CommandForm::Shell(t.to_string())
}

/// A heredoc (`<<EOF`, `<<-EOF`, `<<"EOF"`) anywhere in a shell-form command.
fn has_heredoc(s: &str) -> bool {
    let b = s.as_bytes();
    (0..b.len().saturating_sub(2)).any(|i| {
        b[i] == b'<' && b[i + 1] == b'<' && {
            let mut j = i + 2;
            if b.get(j) == Some(&b'-') {
                j += 1;
            }
            matches!(b.get(j), Some(c) if c.is_ascii_alphabetic() || *c == b'"' || *c == b'\'' || *c == b'_')
        }
    })
}

/// Parses `text` (at most [`MAX_DOCKERFILE`] bytes, [`MAX_INSTRUCTIONS`] instructions).
pub fn parse(text: &str) -> Result<Parsed> {
    if text.len() > MAX_DOCKERFILE {
        return Err(bad(0, format!("larger than {MAX_DOCKERFILE} bytes")));
    }
    let lines = logical_lines(text)?;
    if lines.len() > MAX_INSTRUCTIONS {
        return Err(bad(0, format!("more than {MAX_INSTRUCTIONS} instructions")));
    }
    let mut global_args = Vec::new();
    let mut from: Option<Line> = None;
    let mut body = Vec::new();
    for (n, text) in lines {
        let (kw, args) = match text.find(char::is_whitespace) {
            Some(i) => (&text[..i], text[i..].trim()),
            None => (text.as_str(), ""),
        };
        let kw = kw.to_ascii_uppercase();
        let need_args = || {
            if args.is_empty() {
                Err(bad(n, format!("{kw} needs arguments")))
            } else {
                Ok(())
            }
        };
        let instruction = match kw.as_str() {
            "FROM" => {
                need_args()?;
                let (fl, rest) = flags(n, args)?;
                for (k, v) in &fl {
                    match (k.as_str(), v.as_str()) {
                        (
                            "platform",
                            "linux/amd64" | "linux/x86_64" | "$BUILDPLATFORM" | "$TARGETPLATFORM",
                        ) => {}
                        _ => {
                            return Err(bad(
                                n,
                                format!(
                                    "FROM --{k}={v} is not supported (Clade builds linux/amd64)"
                                ),
                            ))
                        }
                    }
                }
                let words: Vec<&str> = rest.split_whitespace().collect();
                match words.as_slice() {
                    [image] => Instruction::From(image.to_string()),
                    [_, as_, _] if as_.eq_ignore_ascii_case("as") => {
                        Instruction::From(words[0].to_string())
                    }
                    _ => return Err(bad(n, "FROM takes an image (and optionally AS name)")),
                }
            }
            "RUN" => {
                need_args()?;
                let (fl, rest) = flags(n, args)?;
                if let Some((k, _)) = fl.first() {
                    return Err(bad(n, format!("RUN --{k} is not supported")));
                }
                if has_heredoc(rest) {
                    return Err(bad(n, "heredocs (<<) are not supported"));
                }
                Instruction::Run(command_form(rest))
            }
            "COPY" | "ADD" => {
                need_args()?;
                let add = kw == "ADD";
                let (fl, rest) = flags(n, args)?;
                let (mut chown, mut chmod) = (None, None);
                for (k, v) in fl {
                    match k.as_str() {
                        "chown" => chown = Some(v),
                        "chmod" => chmod = Some(v),
                        "link" => {}
                        "from" => {
                            return Err(bad(
                                n,
                                format!(
                                    "{kw} --from is not supported (multi-stage builds are not)"
                                ),
                            ))
                        }
                        _ => return Err(bad(n, format!("{kw} --{k} is not supported"))),
                    }
                }
                if has_heredoc(rest) {
                    return Err(bad(n, "heredocs (<<) are not supported"));
                }
                let form = command_form(rest);
                Instruction::Copy {
                    args: form,
                    chown,
                    chmod,
                    add,
                }
            }
            "ENV" => {
                need_args()?;
                Instruction::Env(vec![args.to_string()])
            }
            "ARG" => {
                need_args()?;
                Instruction::Arg(vec![args.to_string()])
            }
            "WORKDIR" => {
                need_args()?;
                Instruction::Workdir(args.to_string())
            }
            "USER" => {
                need_args()?;
                Instruction::User(args.to_string())
            }
            "CMD" => {
                need_args()?;
                Instruction::Cmd(command_form(args))
            }
            "ENTRYPOINT" => {
                need_args()?;
                Instruction::Entrypoint(command_form(args))
            }
            "SHELL" => match command_form(args) {
                CommandForm::Exec(v) if !v.is_empty() => Instruction::Shell(v),
                _ => {
                    return Err(bad(
                        n,
                        "SHELL takes a JSON array, e.g. [\"/bin/bash\", \"-c\"]",
                    ))
                }
            },
            "LABEL" | "EXPOSE" | "MAINTAINER" | "STOPSIGNAL" | "VOLUME" | "HEALTHCHECK" => {
                Instruction::Ignored(kw.clone())
            }
            "ONBUILD" => return Err(bad(n, "ONBUILD is not supported")),
            _ => return Err(bad(n, format!("unknown instruction '{kw}'"))),
        };
        let l = Line {
            line: n,
            text: text.clone(),
            instruction,
        };
        match (&from, &l.instruction) {
            (None, Instruction::Arg(_)) => global_args.push(l),
            (None, Instruction::From(_)) => from = Some(l),
            (None, _) => {
                return Err(bad(
                    n,
                    format!("{kw} before FROM: a Dockerfile starts with FROM (or ARGs for it)"),
                ))
            }
            (Some(_), Instruction::From(_)) => {
                return Err(bad(
                    n,
                    "a second FROM: multi-stage builds are not supported",
                ))
            }
            (Some(_), _) => body.push(l),
        }
    }
    let from = from.ok_or_else(|| bad(0, "no FROM instruction"))?;
    Ok(Parsed {
        global_args,
        from,
        body,
    })
}

/// Splits `s` into words as Docker does for ENV, ARG, COPY and friends: whitespace outside
/// quotes separates; `"…"` keeps spaces (with `\"` and `\\` inside), `'…'` is literal,
/// `\x` outside quotes is `x`; with `subst`, `$NAME`, `${NAME}`, `${NAME:-w}` and
/// `${NAME:+w}` are replaced from `vars` (an unset name is empty) outside single quotes.
fn split_words(
    line: usize,
    s: &str,
    vars: &BTreeMap<String, String>,
    subst: bool,
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let chars: Vec<char> = s.chars().collect();
    let mut i = 0;
    let mut quote: Option<char> = None;
    while i < chars.len() {
        let c = chars[i];
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
                i += 1;
                continue;
            }
            (None, '"') | (None, '\'') => {
                quote = Some(c);
                in_word = true;
                i += 1;
                continue;
            }
            (Some(q), c) if c == q => {
                quote = None;
                i += 1;
                continue;
            }
            (Some('\''), c) => {
                word.push(c);
                i += 1;
                continue;
            }
            (_, '\\') => {
                in_word = true;
                match chars.get(i + 1) {
                    Some(&n) if quote.is_none() || n == '"' || n == '\\' || n == '$' => {
                        word.push(n);
                        i += 2;
                    }
                    _ => {
                        word.push('\\');
                        i += 1;
                    }
                }
                continue;
            }
            (_, '$') if subst => {
                in_word = true;
                i = substitute(line, &chars, i, vars, &mut word)?;
                continue;
            }
            _ => {
                in_word = true;
                word.push(c);
                i += 1;
            }
        }
    }
    if quote.is_some() {
        return Err(bad(line, "an unterminated quote"));
    }
    if in_word {
        out.push(word);
    }
    Ok(out)
}

/// Replaces the variable reference at `chars[i]` (a `$`) into `out`; returns the index
/// after it.
fn substitute(
    line: usize,
    chars: &[char],
    i: usize,
    vars: &BTreeMap<String, String>,
    out: &mut String,
) -> Result<usize> {
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '_';
    match chars.get(i + 1) {
        Some('{') => {
            let close = chars[i + 2..]
                .iter()
                .position(|&c| c == '}')
                .map(|p| p + i + 2)
                .ok_or_else(|| bad(line, "an unterminated ${"))?;
            let inner: String = chars[i + 2..close].iter().collect();
            let (name, op) = match inner.find(|c: char| !name_char(c)) {
                Some(p) => (&inner[..p], Some(&inner[p..])),
                None => (inner.as_str(), None),
            };
            if name.is_empty() {
                return Err(bad(line, format!("a bad substitution '${{{inner}}}'")));
            }
            let val = vars.get(name).filter(|v| !v.is_empty());
            match op {
                None => out.push_str(val.map(String::as_str).unwrap_or("")),
                Some(o) if o.starts_with(":-") => match val {
                    Some(v) => out.push_str(v),
                    None => out.push_str(&o[2..]),
                },
                Some(o) if o.starts_with(":+") => {
                    if val.is_some() {
                        out.push_str(&o[2..]);
                    }
                }
                Some(o) => {
                    return Err(bad(
                        line,
                        format!(
                            "the substitution '${{{name}{o}}}' is not supported (only :- and :+)"
                        ),
                    ))
                }
            }
            Ok(close + 1)
        }
        Some(&c) if name_char(c) && !c.is_ascii_digit() => {
            let mut j = i + 1;
            while j < chars.len() && name_char(chars[j]) {
                j += 1;
            }
            let name: String = chars[i + 1..j].iter().collect();
            out.push_str(vars.get(&name).map(String::as_str).unwrap_or(""));
            Ok(j)
        }
        _ => {
            out.push('$');
            Ok(i + 1)
        }
    }
}

/// `s` with its variable references replaced (`\$` is a literal `$`); no word splitting,
/// no quotes (the elements of a JSON-form COPY).
fn expand(line: usize, s: &str, vars: &BTreeMap<String, String>) -> Result<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' if chars.get(i + 1) == Some(&'$') => {
                out.push('$');
                i += 2;
            }
            '$' => i = substitute(line, &chars, i, vars, &mut out)?,
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Ok(out)
}

/// `NAME=value` words (or the old `NAME value` form of ENV).
fn pairs(
    line: usize,
    raw: &str,
    vars: &BTreeMap<String, String>,
    old_form_ok: bool,
) -> Result<Vec<(String, Option<String>)>> {
    let words = split_words(line, raw, vars, true)?;
    let first_has_eq = raw
        .split_whitespace()
        .next()
        .is_some_and(|w| w.contains('='));
    if old_form_ok && !first_has_eq {
        // `ENV NAME the rest of the line`.
        let t = raw.trim();
        let (name, rest) = match t.find(char::is_whitespace) {
            Some(p) => (&t[..p], t[p..].trim()),
            None => return Err(bad(line, format!("ENV {t} needs a value"))),
        };
        let value = split_words(line, rest, vars, true)?.join(" ");
        return Ok(vec![(check_name(line, name)?, Some(value))]);
    }
    words
        .into_iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) => Ok((check_name(line, k)?, Some(v.to_string()))),
            None => Ok((check_name(line, &w)?, None)),
        })
        .collect()
}

fn check_name(line: usize, name: &str) -> Result<String> {
    if name.is_empty() || name.contains(|c: char| c == '=' || c.is_whitespace() || c == '\0') {
        return Err(bad(line, format!("'{name}' is not a variable name")));
    }
    Ok(name.to_string())
}

/// A context-relative source made normal: `./a//b/` → `a/b`; `..` anywhere, an absolute
/// path and NUL are refused (a build reads nothing outside its context).
pub fn context_path(line: usize, src: &str) -> Result<String> {
    if src.contains('\0') {
        return Err(bad(line, "a source path with a NUL byte"));
    }
    let mut parts = Vec::new();
    for c in src.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                return Err(bad(
                    line,
                    format!("the source '{src}' leaves the build context"),
                ))
            }
            c => parts.push(c),
        }
    }
    if parts.is_empty() {
        return Ok(".".into());
    }
    Ok(parts.join("/"))
}

/// `rel` against the directory `cwd` (absolute), normalised, keeping a trailing `/`.
pub fn absolute_in(cwd: &str, rel: &str) -> String {
    let trailing = rel.ends_with('/') || rel.ends_with("/.") || rel == ".";
    let joined = if rel.starts_with('/') {
        rel.to_string()
    } else {
        format!("{}/{rel}", if cwd.is_empty() { "/" } else { cwd })
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    let mut s = format!("/{}", parts.join("/"));
    if trailing && s != "/" {
        s.push('/');
    }
    s
}

fn shell_argv(shell: &[String], cmd: &CommandForm) -> Vec<String> {
    match cmd {
        CommandForm::Exec(v) => v.clone(),
        CommandForm::Shell(s) => shell.iter().cloned().chain([s.clone()]).collect(),
    }
}

impl Parsed {
    /// The FROM line's image with the given build arguments substituted.
    pub fn base_image(&self, build_args: &BTreeMap<String, String>) -> Result<String> {
        let globals = self.globals(build_args)?;
        let Instruction::From(img) = &self.from.instruction else {
            unreachable!("parse keeps a FROM here");
        };
        let v = split_words(self.from.line, img, &globals, true)?;
        match v.as_slice() {
            [one] if !one.is_empty() => Ok(one.clone()),
            _ => Err(bad(self.from.line, format!("FROM {img} names no image"))),
        }
    }

    fn globals(&self, build_args: &BTreeMap<String, String>) -> Result<BTreeMap<String, String>> {
        let mut g = BTreeMap::new();
        for l in &self.global_args {
            let Instruction::Arg(raw) = &l.instruction else {
                continue;
            };
            for (k, v) in pairs(l.line, &raw[0], &g, false)? {
                let val = build_args.get(&k).cloned().or(v).unwrap_or_default();
                g.insert(k, val);
            }
        }
        Ok(g)
    }

    /// Evaluates the instructions after FROM on the base image's `base` defaults.
    pub fn plan(
        &self,
        base: &ImageDefaults,
        build_args: &BTreeMap<String, String>,
    ) -> Result<Plan> {
        let from = self.base_image(build_args)?;
        let globals = self.globals(build_args)?;
        let mut declared: Vec<String> = globals.keys().cloned().collect();
        let mut env: Vec<(String, String)> = base.env.clone();
        let mut args: BTreeMap<String, String> = BTreeMap::new();
        let mut cwd = absolute_in("/", if base.cwd.is_empty() { "/" } else { &base.cwd })
            .trim_end_matches('/')
            .to_string();
        if base.cwd.is_empty() {
            cwd.clear();
        }
        let mut user = base.user.clone();
        let mut entrypoint = base.entrypoint.clone();
        let mut cmd = base.cmd.clone();
        let mut cmd_set_here = false;
        let mut shell: Vec<String> = DEFAULT_SHELL.iter().map(|s| s.to_string()).collect();
        let mut steps = Vec::new();
        let mut ignored = Vec::new();
        for l in &self.body {
            let n = l.line;
            // What substitution sees: ARGs, then ENV over them.
            let mut vars = args.clone();
            vars.extend(env.iter().cloned());
            // What a RUN sees: ENV, plus ARGs that ENV does not set.
            let run_env = || {
                let mut e = env.clone();
                for (k, v) in &args {
                    if !e.iter().any(|(ek, _)| ek == k) {
                        e.push((k.clone(), v.clone()));
                    }
                }
                e
            };
            match &l.instruction {
                Instruction::From(_) => unreachable!("parse refuses a second FROM"),
                Instruction::Run(c) => steps.push(Step {
                    line: n,
                    text: l.text.clone(),
                    action: Action::Run {
                        argv: shell_argv(&shell, c),
                    },
                    env: run_env(),
                    cwd: cwd.clone(),
                    user: user.clone(),
                    force: false,
                }),
                Instruction::Copy {
                    args: form,
                    chown,
                    chmod,
                    add,
                } => {
                    let sub = |s: &str| expand(n, s, &vars);
                    let mut parts = match form {
                        CommandForm::Exec(v) => {
                            v.iter().map(|s| sub(s)).collect::<Result<Vec<_>>>()?
                        }
                        CommandForm::Shell(s) => split_words(n, s, &vars, true)?,
                    };
                    let kw = if *add { "ADD" } else { "COPY" };
                    if parts.len() < 2 {
                        return Err(bad(n, format!("{kw} needs a source and a destination")));
                    }
                    let dest_s = parts.pop().expect("two or more");
                    if *add {
                        for s in &parts {
                            let l = s.to_ascii_lowercase();
                            if l.contains("://") || l.starts_with("git@") {
                                return Err(bad(n, format!("ADD of a URL ({s}) is not supported: download it in a RUN step")));
                            }
                            if [
                                ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz",
                                ".tar.zst",
                            ]
                            .iter()
                            .any(|x| l.ends_with(x))
                            {
                                return Err(bad(n, format!("ADD of an archive ({s}) is not supported (Docker would unpack it): COPY it and unpack it in a RUN step")));
                            }
                        }
                    }
                    let srcs = parts
                        .iter()
                        .map(|s| context_path(n, s))
                        .collect::<Result<Vec<_>>>()?;
                    if dest_s.is_empty() {
                        return Err(bad(n, "an empty destination"));
                    }
                    let mut dest_abs =
                        absolute_in(if cwd.is_empty() { "/" } else { &cwd }, &dest_s);
                    if srcs.len() > 1 && !dest_abs.ends_with('/') {
                        if !dest_s.ends_with('/') {
                            return Err(bad(n, format!("{kw} with more than one source: the destination must be a directory (end it with /)")));
                        }
                        dest_abs.push('/');
                    }
                    let chown = chown.as_deref().map(sub).transpose()?;
                    let chmod = match chmod.as_deref().map(sub).transpose()? {
                        None => None,
                        Some(m) => Some(
                            u32::from_str_radix(&m, 8)
                                .ok()
                                .filter(|m| *m <= 0o7777)
                                .ok_or_else(|| {
                                    bad(n, format!("--chmod={m} is not an octal mode"))
                                })?,
                        ),
                    };
                    steps.push(Step {
                        line: n,
                        text: l.text.clone(),
                        action: Action::Copy {
                            srcs,
                            dest: dest_abs,
                            chown,
                            chmod,
                        },
                        env: run_env(),
                        cwd: cwd.clone(),
                        user: user.clone(),
                        force: false,
                    })
                }
                Instruction::Env(raw) => {
                    for (k, v) in pairs(n, &raw[0], &vars, true)? {
                        let v = v.ok_or_else(|| {
                            bad(n, format!("ENV {k} needs a value (ENV {k}=value)"))
                        })?;
                        env.retain(|(ek, _)| *ek != k);
                        env.push((k.clone(), v.clone()));
                        vars.insert(k, v);
                    }
                }
                Instruction::Arg(raw) => {
                    for (k, v) in pairs(n, &raw[0], &vars, false)? {
                        let val = build_args
                            .get(&k)
                            .cloned()
                            .or(v)
                            .or_else(|| globals.get(&k).cloned())
                            .unwrap_or_default();
                        declared.push(k.clone());
                        vars.insert(k.clone(), val.clone());
                        args.insert(k, val);
                    }
                }
                Instruction::Workdir(raw) => {
                    let w = split_words(n, raw, &vars, true)?.join(" ");
                    cwd = absolute_in(if cwd.is_empty() { "/" } else { &cwd }, &w)
                        .trim_end_matches('/')
                        .to_string();
                    if cwd.is_empty() {
                        cwd = "/".into();
                    }
                }
                Instruction::User(raw) => {
                    let u = split_words(n, raw, &vars, true)?.join(" ");
                    if u.is_empty() || u.contains(char::is_whitespace) {
                        return Err(bad(n, format!("USER '{u}' is not a user")));
                    }
                    user = u;
                }
                Instruction::Cmd(c) => {
                    cmd = shell_argv(&shell, c);
                    cmd_set_here = true;
                }
                Instruction::Entrypoint(c) => {
                    entrypoint = shell_argv(&shell, c);
                    // Docker: an ENTRYPOINT resets a CMD inherited from the base image.
                    if !cmd_set_here {
                        cmd.clear();
                    }
                }
                Instruction::Shell(v) => shell = v.clone(),
                Instruction::Ignored(kw) => ignored.push(format!("line {n}: {kw}")),
            }
        }
        let unused_args = build_args
            .keys()
            .filter(|k| !declared.contains(k))
            .cloned()
            .collect();
        Ok(Plan {
            from,
            steps,
            defaults: ImageDefaults {
                env,
                cwd,
                user,
                entrypoint,
                cmd,
            },
            ignored,
            unused_args,
        })
    }
}
