//! Unit tests: Dockerfile parsing and evaluation, COPY sources and step keys (no VM).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clade_image::ImageDefaults;

use crate::dockerfile::{parse, Action, Plan};
use crate::error::Error;
use crate::layers::{copy_entries, step_key, CopyEntry, LineBuffer, MAX_LOG_LINE};

fn plan_of(text: &str, args: &[(&str, &str)]) -> crate::Result<Plan> {
    let base = ImageDefaults {
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        cwd: String::new(),
        user: String::new(),
        entrypoint: vec![],
        cmd: vec!["/bin/sh".into()],
    };
    let args: BTreeMap<String, String> = args
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    parse(text)?.plan(&base, &args)
}

fn line_of(e: Error) -> usize {
    match e {
        Error::Dockerfile { line, .. } | Error::Context { line, .. } => line,
        e => panic!("not a Dockerfile error: {e}"),
    }
}

#[test]
fn a_dockerfile_becomes_steps_and_defaults() {
    let p = plan_of(
        r#"# syntax=docker/dockerfile:1
ARG BASE=debian
FROM ${BASE}:12 AS build
ARG VERSION=1.0
ENV APP_HOME=/opt/app \
    GREETING="hello world"
ENV OLD form with spaces
WORKDIR $APP_HOME
# a comment between instructions
RUN echo "$GREETING" > greeting && \
    # a comment inside a continuation
    echo ${VERSION:-none} > version
COPY --chown=user:user src/ ./src/
COPY a.txt b.txt /etc/app/
USER user
WORKDIR sub
RUN ["id", "-u"]
LABEL org.example=1
EXPOSE 8080
ENTRYPOINT ["/usr/bin/app"]
CMD ["--serve"]
"#,
        &[("VERSION", "2.0")],
    )
    .unwrap();
    assert_eq!(p.from, "debian:12");
    assert_eq!(p.steps.len(), 4);
    let s0 = &p.steps[0];
    assert_eq!(s0.line, 10);
    assert_eq!(s0.cwd, "/opt/app");
    assert_eq!(
        s0.action,
        Action::Run {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "echo \"$GREETING\" > greeting &&     echo ${VERSION:-none} > version".into()
            ]
        }
    );
    // RUN sees ENV and the ARGs in scope (the build argument over the default).
    assert!(s0.env.contains(&("GREETING".into(), "hello world".into())));
    assert!(s0.env.contains(&("VERSION".into(), "2.0".into())));
    assert!(s0.env.contains(&("OLD".into(), "form with spaces".into())));
    assert_eq!(
        p.steps[1].action,
        Action::Copy {
            srcs: vec!["src".into()],
            dest: "/opt/app/src/".into(),
            chown: Some("user:user".into()),
            chmod: None,
        }
    );
    assert_eq!(
        p.steps[2].action,
        Action::Copy {
            srcs: vec!["a.txt".into(), "b.txt".into()],
            dest: "/etc/app/".into(),
            chown: None,
            chmod: None,
        }
    );
    assert_eq!(p.steps[3].user, "user");
    assert_eq!(p.steps[3].cwd, "/opt/app/sub");
    assert_eq!(
        p.steps[3].action,
        Action::Run {
            argv: vec!["id".into(), "-u".into()]
        }
    );
    // ARGs are not in the template's environment; ENV is.
    assert!(!p.defaults.env.iter().any(|(k, _)| k == "VERSION"));
    assert!(p
        .defaults
        .env
        .contains(&("APP_HOME".into(), "/opt/app".into())));
    assert_eq!(p.defaults.cwd, "/opt/app/sub");
    assert_eq!(p.defaults.user, "user");
    assert_eq!(p.defaults.entrypoint, vec!["/usr/bin/app".to_string()]);
    assert_eq!(p.defaults.cmd, vec!["--serve".to_string()]);
    assert_eq!(p.ignored, vec!["line 18: LABEL", "line 19: EXPOSE"]);
    assert!(p.unused_args.is_empty());
}

#[test]
fn an_entrypoint_resets_the_base_images_cmd_and_shell_form_uses_the_shell() {
    let p = plan_of("FROM x\nENTRYPOINT exec app\n", &[]).unwrap();
    assert_eq!(p.defaults.entrypoint, vec!["/bin/sh", "-c", "exec app"]);
    assert!(p.defaults.cmd.is_empty());
    let p = plan_of(
        "FROM x\nSHELL [\"/bin/bash\", \"-euc\"]\nRUN echo hi\n",
        &[("NOPE", "1")],
    )
    .unwrap();
    assert_eq!(
        p.steps[0].action,
        Action::Run {
            argv: vec!["/bin/bash".into(), "-euc".into(), "echo hi".into()]
        }
    );
    assert_eq!(p.unused_args, vec!["NOPE".to_string()]);
}

#[test]
fn substitution_quotes_and_escapes() {
    let p = plan_of(
        "FROM x\nARG A=1\nENV B=\"$A two\" C='$A' D=\\$A E=${UNSET:-dflt} F=${A:+set}\n",
        &[],
    )
    .unwrap();
    let env: BTreeMap<_, _> = p.defaults.env.into_iter().collect();
    assert_eq!(env["B"], "1 two");
    assert_eq!(env["C"], "$A");
    assert_eq!(env["D"], "$A");
    assert_eq!(env["E"], "dflt");
    assert_eq!(env["F"], "set");
}

#[test]
fn what_is_not_supported_is_refused_with_its_line() {
    let cases: &[(&str, usize)] = &[
        ("RUN echo\nFROM x\n", 1),
        ("FROM x\nFROM y\n", 2),
        ("FROM x AS a\nCOPY --from=a /x /y\n", 2),
        ("FROM x\n\nADD https://example.com/f /f\n", 3),
        ("FROM x\nADD app.tar.gz /opt/\n", 2),
        ("FROM x\nRUN --mount=type=cache,target=/c true\n", 2),
        ("FROM x\nRUN <<EOF\necho hi\nEOF\n", 2),
        ("FROM x\nONBUILD RUN true\n", 2),
        ("FROM x\nFROBNICATE\n", 2),
        ("# escape=`\nFROM x\n", 1),
        ("FROM --platform=linux/arm64 x\n", 1),
        ("FROM x\nCOPY ../secret /s\n", 2),
        ("FROM x\nCOPY a b c\n", 2),
        ("FROM x\nENV A\n", 2),
        ("FROM x\nCOPY --chmod=999 a /a\n", 2),
        ("FROM x\nENV A=\"unterminated\n", 2),
        ("FROM x\nENV A=${B:?err}\n", 2),
        ("FROM x\nUSER\n", 2),
        ("", 0),
    ];
    for (text, line) in cases {
        let e = plan_of(text, &[]).expect_err(text);
        let msg = e.to_string();
        assert_eq!(line_of(e), *line, "{text:?}: {msg}");
    }
}

#[test]
fn hostile_dockerfiles_are_errors_not_panics() {
    // Truncated and odd inputs: every prefix of a real Dockerfile, and byte soup.
    let text = "ARG X=1\nFROM a:${X}\nENV A=\"b c\" D=${X:-e}\nCOPY [\"s\", \"/d/\"]\nRUN x \\\n y\nUSER u:g\n";
    for i in 0..=text.len() {
        if text.is_char_boundary(i) {
            let _ = plan_of(&text[..i], &[]);
        }
    }
    for s in [
        "FROM \u{0}",
        "FROM x\nENV ${",
        "FROM x\nENV $",
        "FROM x\nCOPY \\",
        "FROM x\nWORKDIR ${}",
        "\\\n\\\n",
        "FROM x\nENV =a",
    ] {
        let _ = plan_of(s, &[]);
    }
    assert!(parse(&"#\n".repeat(1 << 20)).is_err());
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("clade-builder-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn copy_sources_resolve_inside_the_context_only() {
    let d = tmp("copy");
    let ctx = d.join("ctx");
    std::fs::create_dir_all(ctx.join("src/sub")).unwrap();
    std::fs::write(ctx.join("src/a.py"), "a").unwrap();
    std::fs::write(ctx.join("src/sub/b.py"), "b").unwrap();
    std::fs::write(ctx.join("top.txt"), "t").unwrap();
    std::fs::write(d.join("outside"), "secret").unwrap();
    std::os::unix::fs::symlink("a.py", ctx.join("src/link")).unwrap();
    std::os::unix::fs::symlink("../outside", ctx.join("escape")).unwrap();
    // A directory: its contents under the destination, symlinks kept as symlinks.
    let e = copy_entries(3, &ctx, &["src".into()], "/app/", None).unwrap();
    let dests: Vec<String> = e
        .iter()
        .map(|x| match x {
            CopyEntry::Dir { dest, .. }
            | CopyEntry::File { dest, .. }
            | CopyEntry::Symlink { dest, .. } => dest.display().to_string(),
        })
        .collect();
    assert_eq!(
        dests,
        [
            "/app",
            "/app/a.py",
            "/app/link",
            "/app/sub",
            "/app/sub/b.py"
        ]
    );
    assert!(matches!(&e[2], CopyEntry::Symlink { target, .. } if target == Path::new("a.py")));
    // A file to a directory, to a path; a glob.
    let e = copy_entries(3, &ctx, &["top.txt".into()], "/etc/", None).unwrap();
    assert!(matches!(&e[0], CopyEntry::File { dest, .. } if dest == Path::new("/etc/top.txt")));
    let e = copy_entries(3, &ctx, &["top.txt".into()], "/etc/renamed", Some(0o600)).unwrap();
    assert!(
        matches!(&e[0], CopyEntry::File { dest, mode: 0o600, .. } if dest == Path::new("/etc/renamed"))
    );
    let e = copy_entries(3, &ctx, &["src/*.py".into()], "/x/", None).unwrap();
    assert_eq!(e.len(), 1);
    // Refused: a symlink out of the context, a missing file, a glob that matches
    // nothing, several sources to a file.
    for (srcs, dest) in [
        (vec!["escape"], "/x"),
        (vec!["missing"], "/x"),
        (vec!["*.nothing"], "/x/"),
        (vec!["top.txt", "src"], "/x"),
    ] {
        let srcs: Vec<String> = srcs.into_iter().map(String::from).collect();
        let e = copy_entries(7, &ctx, &srcs, dest, None).expect_err(&format!("{srcs:?}"));
        assert!(matches!(e, Error::Context { line: 7, .. }), "{e}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_steps_key_depends_on_what_it_does_not_on_its_line() {
    let a = plan_of("FROM x\nRUN make\n", &[]).unwrap();
    let b = plan_of("FROM x\n\n\nRUN make\n", &[]).unwrap();
    let c = plan_of("FROM x\nENV A=1\nRUN make\n", &[]).unwrap();
    let d = plan_of("FROM x\nUSER u\nRUN make\n", &[]).unwrap();
    let k = |p: &Plan, parent: &str, content: &str| step_key(parent, &p.steps[0], content);
    assert_eq!(k(&a, "p", ""), k(&b, "p", ""));
    assert_ne!(k(&a, "p", ""), k(&c, "p", ""));
    assert_ne!(k(&a, "p", ""), k(&d, "p", ""));
    assert_ne!(k(&a, "p", ""), k(&a, "q", ""));
    assert_ne!(k(&a, "p", ""), k(&a, "p", "content"));
}

/// A RUN step's output without newlines (a progress bar, a binary) reaches the log in
/// pieces of at most [`MAX_LOG_LINE`] bytes, each marked: nothing grows with it.
#[test]
fn output_without_newlines_is_logged_in_bounded_pieces() {
    let mut lines: Vec<String> = Vec::new();
    let mut log = |l: &str| lines.push(l.to_string());
    let mut b = LineBuffer::default();
    // 1 MiB without a newline, in 64 KiB chunks, then "end\nlast" and a 3-byte
    // character straddling a piece's end.
    for _ in 0..16 {
        b.push(&[b'x'; 64 << 10], &mut log);
    }
    b.push(b"end\nshort\n", &mut log);
    let mut odd = vec![b'y'; MAX_LOG_LINE - 1];
    odd.extend_from_slice("\u{20ac}".as_bytes());
    odd.extend_from_slice(b"z\nlast");
    b.push(&odd, &mut log);
    b.finish(&mut log);
    let longest = lines.iter().map(|l| l.len()).max().unwrap();
    assert!(longest <= MAX_LOG_LINE + 64, "a line of {longest} bytes");
    let split: Vec<&String> = lines.iter().filter(|l| l.ends_with("bytes]")).collect();
    // 1 MiB in 4 KiB pieces, and the piece of the last long line cut before its
    // character.
    assert_eq!(split.len(), 257);
    assert!(split[0].contains("[line split: longer than 4096 bytes]"));
    // Nothing lost: the pieces and the end are the output.
    let text: String = lines
        .iter()
        .map(|l| l.trim_end_matches(" [line split: longer than 4096 bytes]"))
        .collect::<Vec<_>>()
        .join("|");
    assert!(
        text.starts_with(&"x".repeat(MAX_LOG_LINE)),
        "{}",
        &text[..64]
    );
    assert!(text.contains(&format!("{}|end|short|", "x".repeat(100))));
    assert!(
        text.contains(&format!("{}|\u{20ac}z|last", "y".repeat(100))),
        "{}",
        &text[text.len() - 64..]
    );
    assert_eq!(lines.last().unwrap(), "last");
}
