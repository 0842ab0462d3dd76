//! The cluster's links with real certificates made here (openssl): PostgreSQL 15 with
//! `ssl=on` and `hostssl` only, reached with each `sslmode`, and a node's hop to an HTTPS
//! node verified to the cluster CA.
//!
//! PostgreSQL is started as the unprivileged user `postgres` (as `tests/e2b/cluster.py`
//! does), so the test needs root and Debian's postgresql-15; without them it says so and
//! checks nothing of PostgreSQL.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use clade_cluster::db::{Db, NodeRow};
use clade_cluster::hop::{check_address, Hop};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

fn sh(cmd: &mut Command) {
    let out = cmd.output().expect("running a command");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn openssl(dir: &Path, args: &[&str]) {
    sh(Command::new("openssl").current_dir(dir).args(args));
}

/// A CA `name` (name.key, name.pem) in `dir`.
fn ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ],
    );
}

/// A server certificate `name` (name.key, name.pem) for `san`, signed by CA `by`.
fn server(dir: &Path, name: &str, san: &str, by: &str) {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    std::fs::write(
        dir.join(format!("{name}.ext")),
        format!("subjectAltName={san}\nextendedKeyUsage=serverAuth\n"),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{by}.pem"),
            "-CAkey",
            &format!("{by}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.pem"),
        ],
    );
}

fn temp_dir(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("clade-cluster-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A directory removed when dropped (a failed assertion too).
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Self {
        Self(temp_dir(what))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// PostgreSQL in a directory of its own, stopped when dropped.
struct Pg {
    dir: PathBuf,
}

impl Drop for Pg {
    fn drop(&mut self) {
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(format!("{PG_BIN}/pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// PostgreSQL on 127.0.0.1:`port` with TLS (`cert`/`key` signed by `ca.pem` in `certs`)
/// that takes TCP clients over TLS only (`hostssl`).
fn start_postgres(certs: &Path, port: u16) -> Pg {
    let dir = temp_dir("pg");
    let pg = Pg { dir: dir.clone() };
    for f in ["pg.pem", "pg.key"] {
        std::fs::copy(certs.join(f), dir.join(f)).unwrap();
    }
    std::fs::write(dir.join("pw"), "clade-pg-password\n").unwrap();
    sh(Command::new("chown")
        .arg("-R")
        .arg("postgres:postgres")
        .arg(&dir));
    sh(Command::new("chmod").arg("0600").arg(dir.join("pg.key")));
    sh(Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(format!("{PG_BIN}/initdb"))
        .arg("-D")
        .arg(dir.join("data"))
        .args([
            "-U",
            "clade",
            "--auth-local=peer",
            "--auth-host=scram-sha-256",
        ])
        .arg(format!("--pwfile={}", dir.join("pw").display())));
    std::fs::write(
        dir.join("data/pg_hba.conf"),
        "local all all peer\nhostssl all all 127.0.0.1/32 scram-sha-256\n",
    )
    .unwrap();
    let d = dir.display();
    sh(Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(format!("{PG_BIN}/pg_ctl"))
        .arg("-D")
        .arg(dir.join("data"))
        .arg("-l")
        .arg(dir.join("log"))
        .args(["-w", "-o"])
        .arg(format!(
            "-k {d} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off -c ssl=on \
             -c ssl_cert_file={d}/pg.pem -c ssl_key_file={d}/pg.key"
        ))
        .arg("start"));
    pg
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn connect(url: &str) -> Result<bool, String> {
    let db = Db::connect(url).map_err(|e| e.to_string())?;
    db.blocking(|c| async move {
        c.query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .map(|r| r.get::<_, bool>(0))
    })
    .map_err(|e| e.to_string())
}

#[test]
fn postgres_is_reached_as_sslmode_says() {
    let root = nix_is_root();
    if !root || !Path::new(PG_BIN).join("initdb").exists() {
        eprintln!("skipped: needs root and {PG_BIN} (PostgreSQL 15)");
        return;
    }
    let scratch = Scratch::new("pg-certs");
    let certs = &scratch.0;
    ca(certs, "ca");
    ca(certs, "other-ca");
    server(certs, "pg", "IP:127.0.0.1", "ca");
    let port = free_port();
    let _pg = start_postgres(certs, port);
    let ca = certs.join("ca.pem").display().to_string();
    let other = certs.join("other-ca.pem").display().to_string();
    let base = format!("postgres://clade:clade-pg-password@127.0.0.1:{port}/postgres");

    // verify-full: the chain and the name (127.0.0.1) hold; the connection is TLS.
    assert_eq!(
        connect(&format!("{base}?sslmode=verify-full&sslrootcert={ca}")),
        Ok(true)
    );
    // The keyword/value form says the same.
    assert_eq!(
        connect(&format!(
            "host=127.0.0.1 port={port} user=clade password=clade-pg-password dbname=postgres \
             sslmode=verify-full sslrootcert='{ca}'"
        )),
        Ok(true)
    );
    // A CA that did not sign the server's certificate: refused, saying why.
    let e = connect(&format!("{base}?sslmode=verify-full&sslrootcert={other}")).unwrap_err();
    assert!(e.contains("TLS") && e.contains("UnknownIssuer"), "{e}");
    let e = connect(&format!("{base}?sslmode=verify-ca&sslrootcert={other}")).unwrap_err();
    assert!(e.contains("UnknownIssuer"), "{e}");
    // A host name the certificate does not name: verify-full refuses, verify-ca does not
    // look at names.
    let named = format!(
        "host=db.example hostaddr=127.0.0.1 port={port} user=clade password=clade-pg-password \
         dbname=postgres sslrootcert={ca}"
    );
    let e = connect(&format!("{named} sslmode=verify-full")).unwrap_err();
    assert!(e.contains("not valid for name \"db.example\""), "{e}");
    assert_eq!(connect(&format!("{named} sslmode=verify-ca")), Ok(true));
    // require: encrypted, the certificate not checked; prefer (the default) takes TLS.
    assert_eq!(connect(&format!("{base}?sslmode=require")), Ok(true));
    assert_eq!(connect(&base), Ok(true));
    // disable against a server that takes TLS only: refused by the server.
    let e = connect(&format!("{base}?sslmode=disable")).unwrap_err();
    assert!(e.contains("no pg_hba.conf entry"), "{e}");
    assert!(!e.contains("clade-pg-password"), "{e}");
    // verify-full without a CA: said before connecting.
    let e = connect(&format!("{base}?sslmode=verify-full")).unwrap_err();
    assert!(e.contains("sslrootcert"), "{e}");
}

fn nix_is_root() -> bool {
    // The effective uid, from the kernel (no libc call needed in a test).
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

fn node_row(address: String) -> NodeRow {
    NodeRow {
        name: "n2".into(),
        address,
        vcpus: 1,
        mem_mib: 1,
        takes_sandboxes: true,
        draining: false,
        drained: false,
        templates: Vec::new(),
        live: true,
        lease_left_s: 1.0,
        used_vcpus: 0,
        used_mem_mib: 0,
        sandboxes: 0,
    }
}

#[test]
fn hops_go_over_https_verified_to_the_cluster_ca() {
    let scratch = Scratch::new("hop-certs");
    let certs = &scratch.0;
    ca(certs, "ca");
    ca(certs, "other-ca");
    server(certs, "node", "IP:127.0.0.1", "ca");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // A node serving HTTPS the way `clade serve --tls-cert --tls-key` does, answering
        // with the cluster secret it was sent.
        let cfg =
            sandbox::http::tls::server_config(&certs.join("node.pem"), &certs.join("node.key"))
                .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let tls = sandbox::http::tls::TlsListener::new(listener, Arc::clone(&cfg)).unwrap();
        let app = axum::Router::new().route(
            "/echo",
            axum::routing::get(|h: axum::http::HeaderMap| async move {
                h.get(clade_cluster::HOP_HEADER)
                    .map(|v| v.to_str().unwrap_or("").to_string())
                    .unwrap_or_default()
            }),
        );
        tokio::spawn(async move { axum::serve(tls, app).await });
        let to = node_row(format!("https://127.0.0.1:{port}"));
        let secret = "a-cluster-secret-of-16+";

        let hop = Hop::new(Some(&certs.join("ca.pem")), false).unwrap();
        let body = hop
            .call(&to, secret, "key", "GET", "/echo", String::new())
            .await
            .unwrap();
        assert_eq!(&body[..], secret.as_bytes());

        // Trusting another CA: the hop is refused in the handshake, nothing is sent.
        let wrong = Hop::new(Some(&certs.join("other-ca.pem")), false).unwrap();
        let e = wrong
            .call(&to, secret, "key", "GET", "/echo", String::new())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("n2") && e.contains("UnknownIssuer"), "{e}");
        let req = axum::http::Request::get("/echo")
            .body(axum::body::Body::empty())
            .unwrap();
        let resp = wrong.forward("n2", &to.address, secret, req).await;
        assert_eq!(resp.status(), axum::http::StatusCode::BAD_GATEWAY);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains("UnknownIssuer"), "{body}");

        // No CA at all: an https:// node cannot be verified, said before connecting.
        let none = Hop::new(None, false).unwrap();
        let e = none
            .call(&to, secret, "key", "GET", "/echo", String::new())
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("--cluster-ca"), "{e}");
    });
}

#[test]
fn the_secret_goes_in_clear_text_only_to_loopback_or_when_allowed() {
    for a in [
        "http://127.0.0.1:3000",
        "http://[::1]:3000",
        "http://localhost:3000",
    ] {
        check_address(a, false, false).unwrap();
    }
    let e = check_address("http://10.231.0.2:3000", true, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("clear text") && e.contains("--cluster-plain-http"),
        "{e}"
    );
    check_address("http://10.231.0.2:3000", false, true).unwrap();
    check_address("https://10.231.0.2:3000", true, false).unwrap();
    let e = check_address("https://10.231.0.2:3000", false, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--cluster-ca"), "{e}");
    assert!(check_address("ftp://10.231.0.2", true, true).is_err());
    assert!(check_address("10.231.0.2:3000", true, true).is_err());
}
