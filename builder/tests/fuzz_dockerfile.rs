//! Bounded fuzzing of the Dockerfile parser and evaluator (a Dockerfile is input from a
//! user or a tenant): mutations of a real Dockerfile (lines dropped, repeated and swapped,
//! tokens replaced by ones the grammar cares about, bytes flipped) must each parse and
//! evaluate or be refused with an error naming a line: never a panic, never a path outside
//! the context among COPY sources. Runs in CI (seconds).

use std::collections::BTreeMap;

use clade_builder::dockerfile::{parse, Action};
use clade_builder::Error;
use clade_image::ImageDefaults;

const ROUNDS: usize = 20_000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const SAMPLE: &str = r#"# syntax=docker/dockerfile:1
ARG BASE=debian
FROM ${BASE}:12 AS build
ARG VERSION=1.0
ENV APP_HOME=/opt/app \
    GREETING="hello world" OTHER='single $quoted'
WORKDIR $APP_HOME
RUN echo "$GREETING" > greeting && \
    echo ${VERSION:-none} > version
COPY --chown=user:user --chmod=0644 src/ ./src/
COPY ["a b.txt", "c.txt", "/etc/app/"]
ADD tool.sh /usr/local/bin/
USER user:group
SHELL ["/bin/bash", "-euc"]
RUN ["id", "-u"]
LABEL a=b
EXPOSE 8080
ENTRYPOINT ["/usr/bin/app"]
CMD --serve
"#;

const TOKENS: &[&str] = &[
    "\\", "\"", "'", "$", "${", "}", "${A:-", "${A:?x}", "[", "]", "\n", " ", "--", "--from=x",
    "=", "..", "../", "/", "*", "\0", "<<EOF", "FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "USER",
    "WORKDIR", "ONBUILD", "#", "é", "\u{202e}", "--chmod=", "--chown=", "AS",
];

fn mutate(rng: &mut Rng, text: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    for _ in 0..1 + rng.below(4) {
        if lines.is_empty() {
            break;
        }
        let i = rng.below(lines.len());
        match rng.below(6) {
            0 => {
                lines.remove(i);
            }
            1 => {
                let l = lines[i].clone();
                lines.insert(rng.below(lines.len() + 1), l);
            }
            2 => {
                let j = rng.below(lines.len());
                lines.swap(i, j);
            }
            3 | 4 => {
                let l = &mut lines[i];
                let mut cut = rng.below(l.len() + 1);
                while !l.is_char_boundary(cut) {
                    cut -= 1;
                }
                l.insert_str(cut, TOKENS[rng.below(TOKENS.len())]);
            }
            _ => {
                let mut b = lines[i].clone().into_bytes();
                if !b.is_empty() {
                    let k = rng.below(b.len());
                    b[k] ^= 1 << rng.below(7);
                }
                lines[i] = String::from_utf8_lossy(&b).into_owned();
            }
        }
    }
    lines.join("\n")
}

#[test]
fn mutated_dockerfiles_parse_or_are_refused() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let base = ImageDefaults {
        env: vec![("PATH".into(), "/bin".into())],
        ..Default::default()
    };
    let args: BTreeMap<String, String> = [("VERSION".to_string(), "2".to_string())].into();
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..ROUNDS {
        let text = mutate(&mut rng, SAMPLE);
        let lines = text.lines().count();
        match parse(&text).and_then(|p| p.plan(&base, &args)) {
            Ok(plan) => {
                ok += 1;
                for s in &plan.steps {
                    if let Action::Copy { srcs, dest, .. } = &s.action {
                        for src in srcs {
                            assert!(
                                !src.split('/').any(|c| c == "..") && !src.starts_with('/'),
                                "{src:?} from {text:?}"
                            );
                        }
                        assert!(dest.starts_with('/'), "{dest:?}");
                    }
                }
            }
            Err(Error::Dockerfile { line, .. }) => {
                refused += 1;
                assert!(line <= lines, "line {line} of {lines}: {text:?}");
            }
            Err(e) => panic!("not a Dockerfile error: {e}"),
        }
    }
    // Both sides are exercised.
    assert!(
        ok > ROUNDS / 20 && refused > ROUNDS / 20,
        "ok {ok}, refused {refused}"
    );
}
