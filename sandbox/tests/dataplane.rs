//! The data plane (envd's protocol) end to end through the service's router, against a
//! real `clade-agent --listen-unix` per sandbox (the host-agent test harness: no VM).
//! Both Connect codecs, streaming envelopes, exit codes, stdin, signals, file transfers
//! with checksums, filesystem calls, and malformed requests.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use prost::Message;
use sandbox::envd::pb;
use sandbox::hostagent::{HostAgentDriver, TEMPLATE};
use sandbox::http::{router, AppState};
use sandbox::{CreateRequest, Host, HostConfig};
use serde_json::{json, Value};
use tower::ServiceExt;

/// Builds `clade-agent` once, in a target directory of its own (the outer `cargo test`
/// holds the main one).
fn agent_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("agent-build");
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-agent/Cargo.toml");
        let status = std::process::Command::new(env!("CARGO"))
            .args([
                "build",
                "--quiet",
                "--bin",
                "clade-agent",
                "--manifest-path",
            ])
            .arg(&manifest)
            .arg("--target-dir")
            .arg(&target)
            .status()
            .expect("run cargo build for clade-agent");
        assert!(status.success(), "building clade-agent failed");
        target.join("debug/clade-agent")
    })
}

struct Env {
    app: Router,
    host: Arc<Host>,
    id: String,
    dir: PathBuf,
}

fn setup(name: &str) -> Env {
    setup_with(name, false)
}

/// With `auto_resume`: created with a timeout that pauses and auto-resume on, so that a
/// data-plane request wakes it from a pause.
fn setup_with(name: &str, auto_resume: bool) -> Env {
    setup_req(name, |r| {
        r.auto_pause = auto_resume;
        r.auto_resume = auto_resume;
    })
}

/// A sandbox of a create request that `f` adjusts.
fn setup_req(name: &str, f: impl FnOnce(&mut CreateRequest)) -> Env {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("dataplane-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("scratch")).unwrap();
    HostAgentDriver::install_template(&dir).unwrap();
    let host = Host::open(
        HostConfig::new(dir.clone()),
        Arc::new(HostAgentDriver::new(agent_bin().to_path_buf())),
    )
    .unwrap();
    let mut req = CreateRequest {
        template: TEMPLATE.into(),
        timeout_s: 300,
        env_vars: [("SB_VAR".to_string(), "from-create".to_string())].into(),
        ..Default::default()
    };
    f(&mut req);
    let rec = host.create(req).unwrap();
    let host = Arc::new(host);
    let app = router(AppState {
        host: host.clone(),
        api_key: Arc::new("k".into()),
        domain: None,
        sessions: Default::default(),
        builds: Arc::new(sandbox::build::Builds::new(
            std::path::Path::new("/nonexistent"),
            None,
        )),
    });
    Env {
        app,
        host,
        id: rec.id,
        dir: dir.join("scratch"),
    }
}

impl Env {
    fn req(&self, method: &str, uri: &str, ct: Option<&str>, body: Vec<u8>) -> Request<Body> {
        let mut b = Request::builder()
            .method(method)
            .uri(uri)
            .header("e2b-sandbox-id", &self.id)
            .header("e2b-sandbox-port", "49983");
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        b.body(Body::from(body)).unwrap()
    }

    async fn send(&self, r: Request<Body>) -> (StatusCode, String, Vec<u8>) {
        let resp = self.app.clone().oneshot(r).await.unwrap();
        let status = resp.status();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let body = resp
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec();
        (status, ct, body)
    }

    /// A unary JSON call: status and body.
    async fn unary(&self, method: &str, body: Value) -> (StatusCode, Value) {
        let (s, _, b) = self
            .send(self.req(
                "POST",
                &format!("/{method}"),
                Some("application/json"),
                serde_json::to_vec(&body).unwrap(),
            ))
            .await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }
}

fn envelope(payload: &[u8]) -> Vec<u8> {
    let mut v = vec![0];
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v
}

/// Splits a streaming body into (flags, payload) envelopes; panics on a malformed one
/// (the server must never send one).
fn envelopes(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while !b.is_empty() {
        assert!(b.len() >= 5, "truncated envelope");
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        out.push((b[0], b[5..5 + len].to_vec()));
        b = &b[5 + len..];
    }
    out
}

/// A JSON stream's events and its end-of-stream JSON.
fn json_stream(body: &[u8]) -> (Vec<Value>, Value) {
    let env = envelopes(body);
    let (last, msgs) = env.split_last().expect("an end-of-stream envelope");
    assert_eq!(last.0, 2, "stream must end with an end-of-stream envelope");
    let msgs = msgs
        .iter()
        .map(|(f, p)| {
            assert_eq!(*f, 0);
            serde_json::from_slice::<Value>(p).unwrap()["event"].clone()
        })
        .collect();
    (msgs, serde_json::from_slice(&last.1).unwrap())
}

fn b64(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

fn collect_output(events: &[Value], which: &str) -> Vec<u8> {
    events
        .iter()
        .filter_map(|e| e["data"][which].as_str())
        .flat_map(b64)
        .collect()
}

fn start_json(cmd: &str, stdin: bool) -> Vec<u8> {
    envelope(
        serde_json::to_vec(&json!({
            "process": {"cmd": "/bin/sh", "args": ["-c", cmd], "envs": {"REQ_VAR": "r"}},
            "stdin": stdin
        }))
        .unwrap()
        .as_slice(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn start_streams_output_and_exit_codes_json() {
    let env = setup("start-json");
    let (s, ct, body) = env
        .send(env.req(
            "POST",
            "/process.Process/Start",
            Some("application/connect+json"),
            start_json("echo out $SB_VAR $REQ_VAR; echo err >&2; exit 7", false),
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(ct, "application/connect+json");
    let (events, end) = json_stream(&body);
    assert!(events[0]["start"]["pid"].as_u64().unwrap() > 0);
    assert_eq!(collect_output(&events, "stdout"), b"out from-create r\n");
    assert_eq!(collect_output(&events, "stderr"), b"err\n");
    let last = &events[events.len() - 1]["end"];
    assert_eq!(last["exitCode"], 7);
    assert_eq!(last["exited"], true);
    assert_eq!(last["status"], "exit status 7");
    assert_eq!(last["error"], "exit status 7");
    assert_eq!(end, json!({}));

    // A command that does not exist fails the call (no start event).
    let (s, _, body) = env
        .send(env.req(
            "POST",
            "/process.Process/Start",
            Some("application/connect+json"),
            envelope(br#"{"process":{"cmd":"/no/such/program"}}"#),
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    let (events, end) = json_stream(&body);
    assert!(events.is_empty());
    assert_eq!(end["error"]["code"], "not_found", "{end}");
}

#[tokio::test(flavor = "multi_thread")]
async fn start_streams_binary_protobuf() {
    let env = setup("start-proto");
    let req = pb::StartRequest {
        process: Some(pb::ProcessConfig {
            cmd: "/bin/sh".into(),
            args: vec!["-c".into(), "printf 'a\\0b'; exit 0".into()],
            ..Default::default()
        }),
        stdin: Some(false),
        ..Default::default()
    };
    let (s, ct, body) = env
        .send(env.req(
            "POST",
            "/process.Process/Start",
            Some("application/connect+proto"),
            envelope(&req.encode_to_vec()),
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(ct, "application/connect+proto");
    let env_ = envelopes(&body);
    let (end_flags, end) = env_.last().unwrap();
    assert_eq!(*end_flags, 2);
    assert_eq!(end.as_slice(), b"{}");
    let events: Vec<pb::Event> = env_[..env_.len() - 1]
        .iter()
        .map(|(_, p)| {
            pb::EventResponse::decode(p.as_slice())
                .unwrap()
                .event
                .unwrap()
                .event
                .unwrap()
        })
        .collect();
    assert!(matches!(events[0], pb::Event::Start(pb::StartEvent { pid }) if pid > 0));
    let out: Vec<u8> = events
        .iter()
        .filter_map(|e| match e {
            pb::Event::Data(pb::DataEvent {
                output: Some(pb::Output::Stdout(d)),
            }) => Some(d.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(out, b"a\0b");
    assert!(
        matches!(events.last(), Some(pb::Event::End(e)) if e.exit_code == 0 && e.exited && e.error.is_none())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn stdin_signals_list_and_connect() {
    let env = setup("stdin");
    // A background `cat` with stdin: its stream is read concurrently.
    let app = env.app.clone();
    let start = env.req(
        "POST",
        "/process.Process/Start",
        Some("application/connect+json"),
        start_json("cat; echo done", true),
    );
    let resp = app.oneshot(start).await.unwrap();
    let mut body = resp.into_body();
    // The first frame holds the start event.
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    let pid = serde_json::from_slice::<Value>(&first[5..]).unwrap()["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    let rest = tokio::spawn(async move { body.collect().await.unwrap().to_bytes().to_vec() });

    let (s, v) = env.unary("process.Process/List", json!({})).await;
    assert_eq!(s, StatusCode::OK);
    assert!(v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == pid && p["config"]["cmd"] == "/bin/sh"));
    // Reconnect by pid while it runs; its stream sees the same output.
    let connect = env.req(
        "POST",
        "/process.Process/Connect",
        Some("application/connect+json"),
        envelope(
            serde_json::to_vec(&json!({"process": {"pid": pid}}))
                .unwrap()
                .as_slice(),
        ),
    );
    let app2 = env.app.clone();
    let second = tokio::spawn(async move {
        let r = app2.oneshot(connect).await.unwrap();
        r.into_body().collect().await.unwrap().to_bytes().to_vec()
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    for chunk in ["hello ", "world\n"] {
        let (s, v) = env
            .unary(
                "process.Process/SendInput",
                json!({"process": {"pid": pid}, "input": {"stdin": base64_of(chunk.as_bytes())}}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    let (s, _) = env
        .unary(
            "process.Process/CloseStdin",
            json!({"process": {"pid": pid}}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (events, _) = json_stream(&rest.await.unwrap()[..]);
    assert_eq!(collect_output(&events, "stdout"), b"hello world\ndone\n");
    let (events2, _) = json_stream(&second.await.unwrap());
    assert_eq!(events2[0]["start"]["pid"], pid);
    assert!(String::from_utf8(collect_output(&events2, "stdout"))
        .unwrap()
        .ends_with("done\n"));
    assert_eq!(events2.last().unwrap()["end"]["exitCode"], 0);

    // Signals: SIGTERM ends a sleeping process with Go's wording; then it is gone.
    let app3 = env.app.clone();
    let sleeper = env.req(
        "POST",
        "/process.Process/Start",
        Some("application/connect+json"),
        start_json("exec sleep 30", false),
    );
    let resp = app3.oneshot(sleeper).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    let pid = serde_json::from_slice::<Value>(&first[5..]).unwrap()["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    let (s, v) = env
        .unary(
            "process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (events, _) = json_stream(&body.collect().await.unwrap().to_bytes());
    let end = &events.last().unwrap()["end"];
    assert_eq!(end["exitCode"], -1);
    assert_eq!(end["exited"], false);
    assert_eq!(end["status"], "signal: terminated");
    // Ended processes leave the table.
    for _ in 0..50 {
        let (_, v) = env.unary("process.Process/List", json!({})).await;
        if !v["processes"]
            .as_array()
            .map(|a| a.iter().any(|p| p["pid"] == pid))
            .unwrap_or(false)
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let (s, v) = env
        .unary(
            "process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["code"], "not_found");
    // Input to a process started without stdin is refused.
    let (s, v) = env
        .unary(
            "process.Process/SendInput",
            json!({"process": {"pid": 1}, "input": {"stdin": "eA=="}}),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
}

fn base64_of(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

fn sha(b: &[u8]) -> u64 {
    // FNV-1a: enough to tell a corrupted transfer from a good one in a test.
    b.iter().fold(0xcbf29ce484222325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x100000001b3)
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn files_round_trip_and_filesystem_calls() {
    let env = setup("files");
    let d = env.dir.to_string_lossy().into_owned();
    let data: Vec<u8> = (0..(3u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    // Octet-stream upload into a directory that does not exist yet.
    let (s, _, b) = env
        .send(env.req(
            "POST",
            &format!("/files?path={d}/new/dir/a.bin"),
            Some("application/octet-stream"),
            data.clone(),
        ))
        .await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v[0]["path"], format!("{d}/new/dir/a.bin"));
    assert_eq!(
        sha(&std::fs::read(env.dir.join("new/dir/a.bin")).unwrap()),
        sha(&data)
    );
    let (s, _, got) = env
        .send(env.req(
            "GET",
            &format!("/files?path={d}/new/dir/a.bin"),
            None,
            vec![],
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(got.len(), data.len());
    assert_eq!(sha(&got), sha(&data));
    // Multipart, two files named by their filenames.
    let mut mp = Vec::new();
    for (name, content) in [("m1.txt", "one"), ("m2.txt", "two")] {
        mp.extend_from_slice(
            format!(
                "--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{d}/{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n{content}\r\n"
            )
            .as_bytes(),
        );
    }
    mp.extend_from_slice(b"--XX--\r\n");
    let (s, _, b) = env
        .send(env.req(
            "POST",
            "/files",
            Some("multipart/form-data; boundary=XX"),
            mp,
        ))
        .await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        std::fs::read_to_string(env.dir.join("m2.txt")).unwrap(),
        "two"
    );
    // Gzip upload.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, b"zipped text").unwrap();
    let mut r = env.req(
        "POST",
        &format!("/files?path={d}/z.txt"),
        Some("application/octet-stream"),
        gz.finish().unwrap(),
    );
    r.headers_mut()
        .insert("content-encoding", "gzip".parse().unwrap());
    assert_eq!(env.send(r).await.0, StatusCode::OK);
    assert_eq!(
        std::fs::read_to_string(env.dir.join("z.txt")).unwrap(),
        "zipped text"
    );
    // Missing file: 404 with envd's JSON body; a directory: 400.
    let (s, _, b) = env
        .send(env.req("GET", &format!("/files?path={d}/nope"), None, vec![]))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["code"], 404);
    let (s, _, _) = env
        .send(env.req("GET", &format!("/files?path={d}"), None, vec![]))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    // Stat / ListDir / MakeDir / Move / Remove.
    let (s, v) = env
        .unary(
            "filesystem.Filesystem/Stat",
            json!({"path": format!("{d}/m1.txt")}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["entry"]["type"], "FILE_TYPE_FILE");
    assert_eq!(v["entry"]["size"], "3");
    assert_eq!(v["entry"]["permissions"], "-rw-r--r--");
    let (s, v) = env
        .unary(
            "filesystem.Filesystem/Stat",
            json!({"path": format!("{d}/nope")}),
        )
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    let (s, _) = env
        .unary(
            "filesystem.Filesystem/MakeDir",
            json!({"path": format!("{d}/k/l")}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = env
        .unary(
            "filesystem.Filesystem/MakeDir",
            json!({"path": format!("{d}/k/l")}),
        )
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::CONFLICT, Some("already_exists"))
    );
    let (s, v) = env
        .unary(
            "filesystem.Filesystem/ListDir",
            json!({"path": &d, "depth": 2}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let mut paths: Vec<String> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap().to_string())
        .collect();
    paths.sort();
    let want: Vec<String> = ["k", "k/l", "m1.txt", "m2.txt", "new", "new/dir", "z.txt"]
        .iter()
        .map(|p| format!("{d}/{p}"))
        .collect();
    assert_eq!(paths, want);
    let (s, v) = env
        .unary(
            "filesystem.Filesystem/Move",
            json!({"source": format!("{d}/m1.txt"), "destination": format!("{d}/k/moved.txt")}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["name"], "moved.txt");
    assert!(!env.dir.join("m1.txt").exists());
    let (s, _) = env
        .unary(
            "filesystem.Filesystem/Remove",
            json!({"path": format!("{d}/k")}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(!env.dir.join("k").exists());
    let (s, _) = env
        .unary(
            "filesystem.Filesystem/Remove",
            json!({"path": format!("{d}/k")}),
        )
        .await;
    assert_eq!(
        s,
        StatusCode::OK,
        "removing what is not there succeeds, as envd's"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_requests_get_connect_errors() {
    let env = setup("malformed");
    let start = "/process.Process/Start";
    // Bad envelope (length beyond the body): 200 + end-of-stream error.
    let (s, _, b) = env
        .send(env.req(
            "POST",
            start,
            Some("application/connect+json"),
            vec![0, 0, 0, 0, 99, b'{'],
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    let (ev, end) = json_stream(&b);
    assert!(ev.is_empty());
    assert_eq!(end["error"]["code"], "invalid_argument");
    // Compressed envelope: unimplemented.
    let (_, _, b) = env
        .send(env.req(
            "POST",
            start,
            Some("application/connect+json"),
            vec![1, 0, 0, 0, 0],
        ))
        .await;
    assert_eq!(json_stream(&b).1["error"]["code"], "unimplemented");
    // Oversized message.
    let (_, _, b) = env
        .send(env.req(
            "POST",
            start,
            Some("application/connect+json"),
            vec![0, 0x7f, 0xff, 0xff, 0xff],
        ))
        .await;
    assert_eq!(json_stream(&b).1["error"]["code"], "resource_exhausted");
    let (s, _, b) = env
        .send(env.req(
            "POST",
            "/process.Process/List",
            Some("application/json"),
            vec![b' '; (4 << 20) + 10],
        ))
        .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        serde_json::from_slice::<Value>(&b).unwrap()["code"],
        "resource_exhausted"
    );
    // Malformed JSON and protobuf.
    let (s, v) = env
        .unary("filesystem.Filesystem/Stat", json!("not an object"))
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_argument"))
    );
    let (s, _, b) = env
        .send(env.req(
            "POST",
            "/filesystem.Filesystem/Stat",
            Some("application/proto"),
            vec![0x0a, 0x7f, 0x01],
        ))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(
        serde_json::from_slice::<Value>(&b).unwrap()["code"],
        "invalid_argument"
    );
    // A streaming content type on a unary method and vice versa.
    let (s, _, _) = env
        .send(env.req(
            "POST",
            "/process.Process/List",
            Some("application/connect+json"),
            vec![],
        ))
        .await;
    assert_eq!(s, StatusCode::NOT_IMPLEMENTED);
    // Unknown methods and services.
    let (s, v) = env.unary("process.Process/Nope", json!({})).await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_IMPLEMENTED, Some("unimplemented"))
    );
    let (s, v) = env.unary("filesystem.Filesystem/WatchDir", json!({})).await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_IMPLEMENTED, Some("unimplemented"))
    );
    let (s, v) = env.unary("other.Service/X", json!({})).await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_IMPLEMENTED, Some("unimplemented"))
    );
    // No selector; a Start without a process.
    let (s, v) = env
        .unary("process.Process/SendSignal", json!({"signal": 9}))
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_argument"))
    );
    let (_, _, b) = env
        .send(env.req(
            "POST",
            start,
            Some("application/connect+json"),
            envelope(b"{}"),
        ))
        .await;
    assert_eq!(json_stream(&b).1["error"]["code"], "invalid_argument");
    // An unknown sandbox: E2B's proxy answer, 502 "... was not found".
    let r = Request::builder()
        .method("GET")
        .uri("/health")
        .header("e2b-sandbox-id", "nosuchsandbox0000000")
        .body(Body::empty())
        .unwrap();
    let resp = env.app.clone().oneshot(r).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    let v: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert!(
        v["message"].as_str().unwrap().contains("was not found"),
        "{v}"
    );
    // Another port of a real sandbox: not open.
    let r = Request::builder()
        .uri("/")
        .header("host", format!("8080-{}.clade.local", env.id))
        .body(Body::empty())
        .unwrap();
    let resp = env.app.clone().oneshot(r).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    // Health by host name routing; the service still answers afterwards.
    let r = Request::builder()
        .uri("/health")
        .header("host", format!("49983-{}.clade.local", env.id))
        .body(Body::empty())
        .unwrap();
    let resp = env.app.clone().oneshot(r).await.unwrap();
    assert_eq!(resp.status(), StatusCode::NO_CONTENT);
    // Control-plane requests are unaffected (still need the API key).
    let r = Request::builder()
        .uri("/sandboxes")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        env.app.clone().oneshot(r).await.unwrap().status(),
        StatusCode::UNAUTHORIZED
    );
}

/// What the data plane adds to an envd-style unary call over a direct agent round trip:
/// `Filesystem/Stat` of `/` over HTTP/1.1 keep-alive (TCP loopback, routing, sandbox
/// lookup, JSON codec, agent call) against the same `Stat` through a direct agent client.
/// Prints p50s; run with `--ignored --nocapture` (timings, not a pass/fail check).
#[test]
#[ignore]
fn dataplane_added_latency() {
    use std::io::{BufRead, BufReader, Read, Write};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let env = setup("latency");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let app = env.app.clone();
    rt.spawn(async move { axum::serve(listener, app).await });
    let n = 2000;
    let p50 = |mut v: Vec<u128>| {
        v.sort();
        v[v.len() / 2]
    };
    // Direct: the agent's own Stat round trip over its socket.
    let vsock = env
        .dir
        .parent()
        .unwrap()
        .join("sandboxes")
        .join(&env.id)
        .join("vm.vsock");
    let c = vmm::agent::Client::connect(&vsock).unwrap();
    let direct: Vec<u128> = (0..n)
        .map(|_| {
            let t = std::time::Instant::now();
            c.stat("/").unwrap();
            t.elapsed().as_micros()
        })
        .collect();
    // Through the data plane.
    let s = std::net::TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    let body = br#"{"path":"/"}"#;
    let req = format!(
        "POST /filesystem.Filesystem/Stat HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        env.id,
        body.len()
    );
    let mut dp = Vec::new();
    for i in 0..n + 50 {
        let t = std::time::Instant::now();
        w.write_all(req.as_bytes()).unwrap();
        w.write_all(body).unwrap();
        let mut len = 0usize;
        let mut status = String::new();
        r.read_line(&mut status).unwrap();
        assert!(status.contains(" 200 "), "{status}");
        loop {
            let mut l = String::new();
            r.read_line(&mut l).unwrap();
            if l == "\r\n" {
                break;
            }
            if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut b = vec![0; len];
        r.read_exact(&mut b).unwrap();
        if i >= 50 {
            dp.push(t.elapsed().as_micros());
        }
    }
    let (d, h) = (p50(direct), p50(dp));
    println!(
        "stat p50: direct agent {d} us, through the data plane {h} us, added {} us",
        h.saturating_sub(d)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn streams_end_but_processes_outlive_them() {
    let env = setup("outlive");
    let marker = env.dir.join("marker");
    let cmd = format!("sleep 0.5; echo done > {}", marker.display());
    // A client that goes away after the start event.
    let resp = env
        .app
        .clone()
        .oneshot(env.req(
            "POST",
            "/process.Process/Start",
            Some("application/connect+json"),
            start_json(&cmd, false),
        ))
        .await
        .unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    let pid = serde_json::from_slice::<Value>(&first[5..]).unwrap()["event"]["start"]["pid"]
        .as_u64()
        .unwrap();
    drop(body);
    let (_, v) = env.unary("process.Process/List", json!({})).await;
    assert!(v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == pid));
    // A stream whose deadline passes ends with deadline_exceeded; the process goes on.
    let mut r = env.req(
        "POST",
        "/process.Process/Connect",
        Some("application/connect+json"),
        envelope(
            serde_json::to_vec(&json!({"process": {"pid": pid}}))
                .unwrap()
                .as_slice(),
        ),
    );
    r.headers_mut()
        .insert("connect-timeout-ms", "100".parse().unwrap());
    let (_, _, b) = env.send(r).await;
    let (events, end) = json_stream(&b);
    assert_eq!(events[0]["start"]["pid"], pid);
    assert_eq!(end["error"]["code"], "deadline_exceeded");
    for _ in 0..100 {
        if marker.exists() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "done\n");
}

/// The stdout of a stream's data events so far.
fn stdout_text(events: &[Value]) -> String {
    String::from_utf8(collect_output(events, "stdout")).unwrap()
}

/// Reads a Start/Connect stream until its stdout contains `want`; returns the body (still
/// open) and the pid from the start event.
async fn read_stream_until(body: &mut Body, want: &str) -> (u64, String) {
    let mut buf = Vec::new();
    loop {
        let f = tokio::time::timeout(std::time::Duration::from_secs(20), body.frame())
            .await
            .expect("output in time")
            .expect("stream open")
            .unwrap();
        if let Ok(d) = f.into_data() {
            buf.extend_from_slice(&d);
        }
        let events: Vec<Value> = envelopes(&buf)
            .into_iter()
            .filter(|(flags, _)| flags & 2 == 0)
            .map(|(_, m)| serde_json::from_slice::<Value>(&m).unwrap()["event"].clone())
            .collect();
        let text = stdout_text(&events);
        if text.contains(want) {
            let pid = events[0]["start"]["pid"].as_u64().unwrap();
            return (pid, text);
        }
    }
}

fn listed(v: &Value, pid: u64) -> Option<Value> {
    v["processes"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["pid"] == pid).cloned())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_secured_sandbox_needs_its_token_or_a_signed_url() {
    use sandbox::envd::access::signature;
    let env = setup_req("secured", |r| r.secure = true);
    let token = env.host.get(&env.id).unwrap().envd_token.expect("a token");
    let with = |mut r: Request<Body>, t: &str| {
        r.headers_mut().insert("x-access-token", t.parse().unwrap());
        r
    };
    let list = || {
        env.req(
            "POST",
            "/process.Process/List",
            Some("application/json"),
            b"{}".to_vec(),
        )
    };
    // The health probe needs nothing; the rest needs the token.
    let (s, _, _) = env.send(env.req("GET", "/health", None, vec![])).await;
    assert!(s.is_success(), "{s}");
    let (s, _, _) = env.send(list()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = env.send(with(list(), "wrong")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = env.send(with(list(), &token)).await;
    assert_eq!(s, StatusCode::OK);
    // Upload with the token, then download through signed URLs without it.
    let d = env.dir.display().to_string();
    let file = format!("{d}/signed.txt");
    let q = |op: &str, exp: Option<i64>, t: &str| {
        let mut s = form_urlencoded::Serializer::new(String::new());
        s.append_pair("path", &file)
            .append_pair("username", "root")
            .append_pair("signature", &signature(&file, op, "root", t, exp));
        if let Some(e) = exp {
            s.append_pair("signature_expiration", &e.to_string());
        }
        format!("/files?{}", s.finish())
    };
    let up = env.req(
        "POST",
        &q("write", None, &token),
        Some("application/octet-stream"),
        b"signed bytes".to_vec(),
    );
    let (s, _, b) = env.send(up).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let (s, _, b) = env
        .send(env.req("GET", &q("read", Some(now + 60), &token), None, vec![]))
        .await;
    assert_eq!((s, b.as_slice()), (StatusCode::OK, &b"signed bytes"[..]));
    for (uri, why) in [
        (q("read", Some(now - 1), &token), "expired"),
        (q("read", None, "another sandbox's token"), "another token"),
        (q("write", None, &token), "a write URL read"),
        (
            q("read", Some(now + 60), &token).replace("signed.txt", "other.txt"),
            "altered path",
        ),
        (format!("/files?path={file}&username=root"), "unsigned"),
    ] {
        let (s, _, _) = env.send(env.req("GET", &uri, None, vec![])).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{why}");
    }
}

/// A `/files` URL signed with `token` for `op` on `file` as `user` ("" for the default
/// user: no `username` parameter).
fn signed_files_url(file: &str, op: &str, user: &str, token: &str) -> String {
    let mut s = form_urlencoded::Serializer::new(String::new());
    s.append_pair("path", file);
    if !user.is_empty() {
        s.append_pair("username", user);
    }
    s.append_pair(
        "signature",
        &sandbox::envd::access::signature(file, op, user, token, None),
    );
    format!("/files?{}", s.finish())
}

/// A multipart body of `file` parts (file name, content), boundary `XX`.
fn multipart(parts: &[(&str, &str)]) -> Vec<u8> {
    let mut mp = Vec::new();
    for (name, content) in parts {
        mp.extend_from_slice(
            format!(
                "--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n{content}\r\n"
            )
            .as_bytes(),
        );
    }
    mp.extend_from_slice(b"--XX--\r\n");
    mp
}

/// Everything under `dir` (relative paths, sorted).
fn tree(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
            if e.file_type().unwrap().is_dir() {
                todo.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A URL signed for one file, one user and one operation does exactly that: every
/// multipart part goes to the signed path or is refused (a second part named after
/// another file creates nothing), and an `Authorization: Basic` header naming another
/// user does not change who writes or reads (issue 56, finding 2).
#[tokio::test(flavor = "multi_thread")]
async fn a_signed_url_writes_only_its_path_as_its_user() {
    use std::os::unix::fs::MetadataExt;
    let env = setup_req("signed-scope", |r| r.secure = true);
    let token = env.host.get(&env.id).unwrap().envd_token.expect("a token");
    let d = env.dir.display().to_string();
    let a = format!("{d}/a.txt");
    // Two parts: the first, whatever its name, is the signed file; the second is refused.
    let body = multipart(&[
        (&format!("{d}/named.txt"), "first"),
        (&format!("{d}/b.txt"), "second"),
    ]);
    let (s, _, b) = env
        .send(env.req(
            "POST",
            &signed_files_url(&a, "write", "root", &token),
            Some("multipart/form-data; boundary=XX"),
            body,
        ))
        .await;
    assert_eq!(
        s,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(
        std::fs::read_to_string(env.dir.join("a.txt")).unwrap(),
        "first"
    );
    assert!(
        !env.dir.join("b.txt").exists(),
        "the unsigned second part was written"
    );
    assert!(!env.dir.join("named.txt").exists());
    // One part: written to the signed path, answered as envd answers.
    let (s, _, b) = env
        .send(env.req(
            "POST",
            &signed_files_url(&a, "write", "root", &token),
            Some("multipart/form-data; boundary=XX"),
            multipart(&[(&format!("{d}/elsewhere.txt"), "again")]),
        ))
        .await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v[0]["path"], a);
    assert_eq!(
        std::fs::read_to_string(env.dir.join("a.txt")).unwrap(),
        "again"
    );
    assert_eq!(tree(&env.dir), vec!["a.txt"]);
    // Signed for the default user (root here), with a Basic header naming `nobody`:
    // written as root (nobody could not write here at all), read as root.
    let nobody = format!("Basic {}", base64_of(b"nobody:"));
    let c = format!("{d}/c.txt");
    let mut r = env.req(
        "POST",
        &signed_files_url(&c, "write", "", &token),
        Some("application/octet-stream"),
        b"by the signed user".to_vec(),
    );
    r.headers_mut()
        .insert("authorization", nobody.parse().unwrap());
    let (s, _, b) = env.send(r).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    assert_eq!(std::fs::metadata(env.dir.join("c.txt")).unwrap().uid(), 0);
    std::fs::write(env.dir.join("secret.txt"), "root only").unwrap();
    std::fs::set_permissions(
        env.dir.join("secret.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let mut r = env.req(
        "GET",
        &signed_files_url(&format!("{d}/secret.txt"), "read", "", &token),
        None,
        vec![],
    );
    r.headers_mut()
        .insert("authorization", nobody.parse().unwrap());
    let (s, _, b) = env.send(r).await;
    assert_eq!((s, b.as_slice()), (StatusCode::OK, &b"root only"[..]));
    // With the token (full access) the SDK's multi-file write still names its files.
    let mut r = env.req(
        "POST",
        "/files",
        Some("multipart/form-data; boundary=XX"),
        multipart(&[
            (&format!("{d}/m1.txt"), "one"),
            (&format!("{d}/m2.txt"), "two"),
        ]),
    );
    r.headers_mut()
        .insert("x-access-token", token.parse().unwrap());
    let (s, _, b) = env.send(r).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        std::fs::read_to_string(env.dir.join("m2.txt")).unwrap(),
        "two"
    );
    // A signature with two (path, user) splits is refused, whatever the split names.
    let tricky = format!("{d}/e:write:root");
    let mut q = form_urlencoded::Serializer::new(String::new());
    q.append_pair("path", &format!("{d}/e"))
        .append_pair("username", "root:write:")
        .append_pair(
            "signature",
            &sandbox::envd::access::signature(&tricky, "write", "", &token, None),
        );
    let (s, _, _) = env
        .send(env.req(
            "POST",
            &format!("/files?{}", q.finish()),
            Some("application/octet-stream"),
            b"x".to_vec(),
        ))
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(!env.dir.join("e").exists());
}

/// Fuzzing the signed multipart upload: thousands of mutated multipart bodies (seeded,
/// so a failure replays) through the whole upload path. Each gets a clear answer (a
/// JSON error or success, never a server error or a panic), and nothing but the signed
/// file ever appears, whatever the parts' names say. Signed for `nobody`, owner of the
/// scratch directory: a handler that wrote where the parts' mutated names say could not
/// litter the host (this host agent writes as the user, on the host's filesystem).
#[tokio::test(flavor = "multi_thread")]
async fn fuzzed_signed_multipart_uploads_write_only_the_signed_path() {
    let env = setup_req("signed-fuzz", |r| r.secure = true);
    let token = env.host.get(&env.id).unwrap().envd_token.expect("a token");
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let nobody: u32 = passwd
        .lines()
        .find_map(|l| l.strip_prefix("nobody:"))
        .and_then(|rest| rest.split(':').nth(1)?.parse().ok())
        .expect("a nobody user");
    std::os::unix::fs::chown(&env.dir, Some(nobody), Some(nobody)).unwrap();
    let d = env.dir.display().to_string();
    let url = signed_files_url(&format!("{d}/target.txt"), "write", "nobody", &token);
    let seeds: Vec<Vec<u8>> = vec![
        multipart(&[(&format!("{d}/x1"), "one"), (&format!("{d}/x2"), "two")]),
        multipart(&[(&format!("{d}/../y"), "a"), ("", "b"), (&format!("{d}/x3"), "c")]),
        format!(
            "--XX\r\nContent-Disposition: form-data; name=\"other\"; filename=\"{d}/x4\"\r\n\r\nz\r\n--XX\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nq\r\n--XX--\r\n"
        )
        .into_bytes(),
    ];
    let pieces: [&[u8]; 8] = [
        b"\r\n",
        b"--XX",
        b"--XX--",
        b"\r\n\r\n",
        b"Content-Disposition: form-data; name=\"file\"; filename=\"",
        b"\"",
        b"\0",
        b"/x5",
    ];
    let mut rng = 0x9e3779b97f4a7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let t0 = std::time::Instant::now();
    let mut cases = 0;
    while cases < 3000 && t0.elapsed() < std::time::Duration::from_secs(8) {
        let mut b = seeds[next() as usize % seeds.len()].clone();
        for _ in 0..1 + next() % 4 {
            let at = next() as usize % (b.len() + 1);
            match next() % 4 {
                0 if !b.is_empty() => {
                    let i = at.min(b.len() - 1);
                    b[i] ^= 1 << (next() % 8);
                }
                1 => {
                    let p = pieces[next() as usize % pieces.len()];
                    b.splice(at..at, p.iter().copied());
                }
                2 => b.truncate(at),
                _ => {
                    let end = (at + 1 + next() as usize % 16).min(b.len());
                    b.drain(at.min(end)..end);
                }
            }
        }
        let (s, ct, body) = env
            .send(env.req("POST", &url, Some("multipart/form-data; boundary=XX"), b))
            .await;
        assert!(
            s == StatusCode::OK || s.is_client_error(),
            "case {cases}: {s} {}",
            String::from_utf8_lossy(&body)
        );
        assert!(ct.starts_with("application/json"), "case {cases}: {ct}");
        let v: Value = serde_json::from_slice(&body).expect("a JSON answer");
        if s.is_client_error() {
            assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        }
        cases += 1;
    }
    eprintln!("{cases} fuzzed uploads in {:?}", t0.elapsed());
    assert!(cases >= 500, "only {cases} cases ran");
    let left = tree(&env.dir);
    assert!(
        left.iter().all(|p| p == "target.txt"),
        "unsigned files were written: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_without_the_token_does_not_wake_a_sandbox() {
    let env = setup_req("unauthorized-wake", |r| {
        r.secure = true;
        r.auto_pause = true;
        r.auto_resume = true;
    });
    let token = env.host.get(&env.id).unwrap().envd_token.unwrap();
    let host = env.host.clone();
    let id = env.id.clone();
    tokio::task::spawn_blocking(move || host.pause(&id, sandbox::PauseOptions::FULL).unwrap())
        .await
        .unwrap();
    let list = |t: Option<&str>| {
        let mut r = env.req(
            "POST",
            "/process.Process/List",
            Some("application/json"),
            b"{}".to_vec(),
        );
        if let Some(t) = t {
            r.headers_mut().insert("x-access-token", t.parse().unwrap());
        }
        r
    };
    for t in [None, Some("wrong")] {
        let (s, _, _) = env.send(list(t)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(
        env.host.get(&env.id).unwrap().state,
        sandbox::State::Paused,
        "an unauthorized request woke it"
    );
    // With the token: auto-resume wakes it.
    let (s, _, _) = env.send(list(Some(&token))).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        env.host.get(&env.id).unwrap().state,
        sandbox::State::Running
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_sandbox_without_auto_resume_stays_paused() {
    let env = setup("paused-is-paused");
    let (s, _, _) = env.send(env.req("GET", "/health", None, vec![])).await;
    assert!(s.is_success(), "running: {s}");
    let host = env.host.clone();
    let id = env.id.clone();
    tokio::task::spawn_blocking(move || host.pause(&id, sandbox::PauseOptions::FULL).unwrap())
        .await
        .unwrap();
    // Every data-plane request gets the answer for a sandbox that is not running (the
    // SDK's is_running() is false), and none of them wakes it.
    for _ in 0..3 {
        let (s, _, b) = env.send(env.req("GET", "/health", None, vec![])).await;
        assert_eq!(s, StatusCode::BAD_GATEWAY);
        let text = String::from_utf8_lossy(&b);
        assert!(
            text.contains("was not found") && text.contains("paused"),
            "{text}"
        );
        let (s, v) = env.unary("process.Process/List", json!({})).await;
        assert_eq!(s, StatusCode::BAD_GATEWAY, "{v}");
    }
    assert_eq!(
        env.host.get(&env.id).unwrap().state,
        sandbox::State::Paused,
        "a request woke a sandbox without auto-resume"
    );
    // connect wakes it; requests are served again.
    let host = env.host.clone();
    let id = env.id.clone();
    tokio::task::spawn_blocking(move || host.connect(&id, 60, false).unwrap())
        .await
        .unwrap();
    let (s, v) = env.unary("process.Process/List", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn background_processes_survive_pause_resume_and_a_service_restart() {
    let env = setup_with("survive", true);
    let script = "i=0; while :; do i=$((i+1)); echo tick-$i; sleep 0.1; done";
    let body = serde_json::to_vec(&json!({
        "process": {"cmd": "/bin/sh", "args": ["-c", script], "envs": {"MINE": "1"}, "cwd": "/tmp"},
        "tag": "counter",
        "stdin": false,
    }))
    .unwrap();
    let resp = env
        .app
        .clone()
        .oneshot(env.req(
            "POST",
            "/process.Process/Start",
            Some("application/connect+json"),
            envelope(&body),
        ))
        .await
        .unwrap();
    let mut start_body = resp.into_body();
    let (pid, _) = read_stream_until(&mut start_body, "tick-2\n").await;

    // Pause: the agent's connections drop (the Start stream ends without an end event),
    // and the process is frozen with its "VM".
    let host = env.host.clone();
    let id = env.id.clone();
    tokio::task::spawn_blocking(move || host.pause(&id, sandbox::PauseOptions::FULL).unwrap())
        .await
        .unwrap();
    let rest = tokio::time::timeout(std::time::Duration::from_secs(20), start_body.collect())
        .await
        .expect("the Start stream ends at the pause")
        .unwrap()
        .to_bytes();
    let (events, end) = json_stream(&rest);
    assert!(!events.iter().any(|e| e.get("end").is_some()), "{events:?}");
    assert_eq!(end["error"]["code"], "unavailable", "{end}");
    // SAFETY: kill with signal 0 only checks that the pid exists.
    let frozen_alive = unsafe { libc::kill(pid as i32, 0) } == 0;
    assert!(frozen_alive, "the process died at the pause");

    // Resume happens on the next data-plane request (auto-resume); a fresh router stands
    // for a restarted service: it knows nothing of the process but the agent does.
    let restarted = router(AppState {
        host: env.host.clone(),
        api_key: Arc::new("k".into()),
        domain: None,
        sessions: Default::default(),
        builds: Arc::new(sandbox::build::Builds::new(
            std::path::Path::new("/nonexistent"),
            None,
        )),
    });
    let env2 = Env {
        app: restarted,
        host: env.host.clone(),
        id: env.id.clone(),
        dir: env.dir.clone(),
    };
    let (s, v) = env2.unary("process.Process/List", json!({})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let p = listed(&v, pid).expect("listed after resume");
    assert_eq!(p["tag"], "counter");
    assert_eq!(p["config"]["cmd"], "/bin/sh");
    assert_eq!(p["config"]["args"][1], script);
    assert_eq!(p["config"]["envs"], json!({"MINE": "1"}));
    assert_eq!(p["config"]["cwd"], "/tmp");

    // Connect by tag: output from now on, counting on from where it was.
    let resp = env2
        .app
        .clone()
        .oneshot(env2.req(
            "POST",
            "/process.Process/Connect",
            Some("application/connect+json"),
            envelope(&serde_json::to_vec(&json!({"process": {"tag": "counter"}})).unwrap()),
        ))
        .await
        .unwrap();
    let mut conn_body = resp.into_body();
    let (pid2, text) = read_stream_until(&mut conn_body, "\n").await;
    assert_eq!(pid2, pid);
    let n: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("tick-"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(n > 2, "{text:?}");

    // Kill by pid: the Connect stream ends with the kill.
    let (s, v) = env2
        .unary(
            "process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let rest = conn_body.collect().await.unwrap().to_bytes();
    let (events, _) = json_stream(&rest);
    assert_eq!(events.last().unwrap()["end"]["status"], "signal: killed");
    let (_, v) = env2.unary("process.Process/List", json!({})).await;
    assert!(listed(&v, pid).is_none(), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_start_timeout_kills_the_process() {
    let env = setup("timeout");
    let mut r = env.req(
        "POST",
        "/process.Process/Start",
        Some("application/connect+json"),
        start_json("exec sleep 30", false),
    );
    r.headers_mut()
        .insert("connect-timeout-ms", "300".parse().unwrap());
    let (_, _, b) = env.send(r).await;
    let (events, end) = json_stream(&b);
    let pid = events[0]["start"]["pid"].as_u64().unwrap();
    assert_eq!(end["error"]["code"], "deadline_exceeded");
    let mut gone = false;
    for _ in 0..100 {
        let (_, v) = env.unary("process.Process/List", json!({})).await;
        if listed(&v, pid).is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(gone, "the timed-out process still runs");
}

/// The envelopes of the next body frame of a stream (10 s at most).
async fn next_frames(body: &mut Body) -> Vec<(u8, Vec<u8>)> {
    let d = tokio::time::timeout(std::time::Duration::from_secs(10), body.frame())
        .await
        .expect("a watch event in time")
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    envelopes(&d)
}

/// The messages of a WatchDir JSON stream (its oneof members by name) and its end.
fn watch_stream(frames: &[(u8, Vec<u8>)]) -> (Vec<Value>, Option<Value>) {
    let mut msgs = Vec::new();
    let mut end = None;
    for (flags, p) in frames {
        let v: Value = serde_json::from_slice(p).unwrap();
        if *flags == 2 {
            end = Some(v);
        } else {
            msgs.push(v);
        }
    }
    (msgs, end)
}

#[tokio::test(flavor = "multi_thread")]
async fn watch_dir_streams_and_polling_watchers() {
    let env = setup("watch");
    let w = env.dir.join("w");
    std::fs::create_dir_all(w.join("sub")).unwrap();
    let watch_req = |path: &Path, recursive: bool, timeout_ms: Option<&str>| {
        let mut r = env.req(
            "POST",
            "/filesystem.Filesystem/WatchDir",
            Some("application/connect+json"),
            envelope(
                serde_json::to_vec(&json!({"path": path, "recursive": recursive}))
                    .unwrap()
                    .as_slice(),
            ),
        );
        if let Some(t) = timeout_ms {
            r.headers_mut()
                .insert("connect-timeout-ms", t.parse().unwrap());
        }
        r
    };

    // A live stream: the start event, then what happens in the tree.
    let resp = env
        .app
        .clone()
        .oneshot(watch_req(&w, true, None))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut frames = Vec::new();
    frames.extend(next_frames(&mut body).await);
    assert_eq!(watch_stream(&frames).0, vec![json!({"start": {}})]);
    std::fs::write(w.join("sub/f.txt"), b"hello").unwrap();
    let want = json!({"filesystem": {"name": "sub/f.txt", "type": "EVENT_TYPE_WRITE"}});
    while !watch_stream(&frames).0.contains(&want) {
        frames.extend(next_frames(&mut body).await);
    }
    assert!(watch_stream(&frames)
        .0
        .contains(&json!({"filesystem": {"name": "sub/f.txt", "type": "EVENT_TYPE_CREATE"}})));
    drop(body);

    // A deadline ends the stream; missing paths, files and bad envelopes are errors.
    let (s, _, b) = env.send(watch_req(&w, false, Some("100"))).await;
    assert_eq!(s, StatusCode::OK);
    let (msgs, end) = watch_stream(&envelopes(&b));
    assert_eq!(msgs[0], json!({"start": {}}));
    assert_eq!(end.unwrap()["error"]["code"], "deadline_exceeded");
    let (_, _, b) = env.send(watch_req(&w.join("nope"), false, None)).await;
    let (msgs, end) = watch_stream(&envelopes(&b));
    assert!(msgs.is_empty());
    assert_eq!(end.unwrap()["error"]["code"], "not_found");
    std::fs::write(w.join("file"), b"x").unwrap();
    let (_, _, b) = env.send(watch_req(&w.join("file"), false, None)).await;
    assert_eq!(
        watch_stream(&envelopes(&b)).1.unwrap()["error"]["code"],
        "invalid_argument"
    );
    let (s, _, b) = env
        .send(env.req(
            "POST",
            "/filesystem.Filesystem/WatchDir",
            Some("application/connect+json"),
            vec![0, 0, 0, 1, 0, b'{'],
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        watch_stream(&envelopes(&b)).1.unwrap()["error"]["code"],
        "invalid_argument"
    );

    // Polling watchers: create, collect, remove.
    let (s, v) = env
        .unary(
            "filesystem.Filesystem/CreateWatcher",
            json!({"path": w, "recursive": false}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let id = v["watcherId"].as_str().unwrap().to_string();
    assert!(id.starts_with('w') && id.len() > 8, "{id}");
    std::fs::rename(w.join("file"), w.join("moved")).unwrap();
    std::fs::remove_file(w.join("moved")).unwrap();
    let mut events = Vec::new();
    let gone = json!({"name": "moved", "type": "EVENT_TYPE_REMOVE"});
    for _ in 0..200 {
        let (s, v) = env
            .unary(
                "filesystem.Filesystem/GetWatcherEvents",
                json!({"watcherId": id}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        events.extend(v["events"].as_array().cloned().unwrap_or_default());
        if events.contains(&gone) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert_eq!(
        events,
        vec![
            json!({"name": "file", "type": "EVENT_TYPE_RENAME"}),
            json!({"name": "moved", "type": "EVENT_TYPE_CREATE"}),
            gone
        ]
    );
    // Collected events are gone; nothing new is an empty list.
    let (_, v) = env
        .unary(
            "filesystem.Filesystem/GetWatcherEvents",
            json!({"watcherId": id}),
        )
        .await;
    assert_eq!(v, json!({"events": []}));
    let (s, _) = env
        .unary(
            "filesystem.Filesystem/RemoveWatcher",
            json!({"watcherId": id}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    for method in ["GetWatcherEvents", "RemoveWatcher"] {
        let (s, v) = env
            .unary(
                &format!("filesystem.Filesystem/{method}"),
                json!({"watcherId": id}),
            )
            .await;
        assert_eq!(
            (s, v["code"].as_str()),
            (StatusCode::NOT_FOUND, Some("not_found"))
        );
    }

    // Binary protobuf: a watcher on a directory that is then removed reports its events,
    // then the error that ended it.
    let gone_dir = env.dir.join("gone");
    std::fs::create_dir(&gone_dir).unwrap();
    let create = pb::WatchRequest {
        path: gone_dir.to_string_lossy().into_owned(),
        ..Default::default()
    };
    let (s, _, b) = env
        .send(env.req(
            "POST",
            "/filesystem.Filesystem/CreateWatcher",
            Some("application/proto"),
            create.encode_to_vec(),
        ))
        .await;
    assert_eq!(s, StatusCode::OK);
    let id = pb::CreateWatcherResponse::decode(&b[..])
        .unwrap()
        .watcher_id;
    std::fs::write(gone_dir.join("x"), b"1").unwrap();
    std::fs::remove_dir_all(&gone_dir).unwrap();
    let get = pb::WatcherRequest { watcher_id: id }.encode_to_vec();
    let mut names = Vec::new();
    let mut end = None;
    for _ in 0..200 {
        let (s, ct, b) = env
            .send(env.req(
                "POST",
                "/filesystem.Filesystem/GetWatcherEvents",
                Some("application/proto"),
                get.clone(),
            ))
            .await;
        if s != StatusCode::OK {
            end = Some((s, serde_json::from_slice::<Value>(&b).unwrap()));
            break;
        }
        assert_eq!(ct, "application/proto");
        let r = pb::GetWatcherEventsResponse::decode(&b[..]).unwrap();
        names.extend(r.events.into_iter().map(|e| (e.name, e.r#type)));
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    let (s, v) = end.expect("the watch ends when its directory goes");
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    assert!(
        names.contains(&("x".into(), pb::EventType::Create as i32)),
        "{names:?}"
    );
    assert!(
        names.contains(&("x".into(), pb::EventType::Remove as i32)),
        "{names:?}"
    );

    // Malformed requests.
    let (s, v) = env
        .unary("filesystem.Filesystem/CreateWatcher", json!({"path": 5}))
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_argument"))
    );
    let (s, v) = env
        .unary(
            "filesystem.Filesystem/CreateWatcher",
            json!({"path": env.dir.join("nope")}),
        )
        .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    let (s, _, _) = env
        .send(env.req(
            "POST",
            "/filesystem.Filesystem/GetWatcherEvents",
            Some("application/proto"),
            vec![0x0a, 0x10, b'w'],
        ))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    // GET /files answers gzip when asked (and only then).
    let text = "compressible ".repeat(10_000);
    std::fs::write(env.dir.join("gz.txt"), &text).unwrap();
    let uri = format!("/files?path={}", env.dir.join("gz.txt").display());
    let mut r = env.req("GET", &uri, None, vec![]);
    r.headers_mut()
        .insert("accept-encoding", "gzip, deflate".parse().unwrap());
    let resp = env.app.clone().oneshot(r).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-encoding"], "gzip");
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(b.len() < text.len() / 10, "{} bytes", b.len());
    let mut plain = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&b[..]), &mut plain).unwrap();
    assert_eq!(plain, text);
    let resp = env
        .app
        .clone()
        .oneshot(env.req("GET", &uri, None, vec![]))
        .await
        .unwrap();
    assert!(resp.headers().get("content-encoding").is_none());
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(b, text.as_bytes());
}

#[tokio::test(flavor = "multi_thread")]
async fn stream_input_writes_in_order_and_refuses_bad_streams() {
    let env = setup("streaminput");
    let input = |req: Vec<u8>| {
        env.req(
            "POST",
            "/process.Process/StreamInput",
            Some("application/connect+json"),
            req,
        )
    };
    let msg = |v: Value| envelope(&serde_json::to_vec(&v).unwrap());
    // A cat with stdin, fed by one StreamInput of two data messages and a keepalive.
    let start_cat = || {
        env.app.clone().oneshot(
            env.req(
                "POST",
                "/process.Process/Start",
                Some("application/connect+json"),
                envelope(
                    &serde_json::to_vec(&json!({
                        "process": {"cmd": "/bin/cat"}, "stdin": true, "tag": "cat-in"
                    }))
                    .unwrap(),
                ),
            ),
        )
    };
    let start_body = start_cat().await.unwrap().into_body();
    let mut body = Vec::new();
    body.extend(msg(json!({"start": {"process": {"tag": "cat-in"}}})));
    body.extend(msg(json!({"data": {"input": {"stdin": "b25l"}}}))); // "one"
    body.extend(msg(json!({"keepalive": {}})));
    body.extend(msg(json!({"data": {"input": {"stdin": "dHdv"}}}))); // "two"
    let (s, _, b) = env.send(input(body)).await;
    assert_eq!(s, StatusCode::OK);
    let (msgs, end) = json_stream(&b);
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    assert!(end.get("error").is_none(), "{end}");
    let (s, v) = env
        .unary(
            "process.Process/CloseStdin",
            json!({"process": {"tag": "cat-in"}}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let rest = tokio::time::timeout(std::time::Duration::from_secs(20), start_body.collect())
        .await
        .expect("cat ends at the end of its stdin")
        .unwrap()
        .to_bytes();
    let (events, end) = json_stream(&rest);
    assert!(end.get("error").is_none(), "{end}");
    assert_eq!(collect_output(&events, "stdout"), b"onetwo");

    // Data before start, a second start, an unknown process, a torn envelope (another
    // cat that stays, so that the starts find it).
    let mut second = start_cat().await.unwrap().into_body();
    second.frame().await.unwrap().unwrap();
    for (body, code) in [
        (
            msg(json!({"data": {"input": {"stdin": "eA=="}}})),
            "invalid_argument",
        ),
        (
            [
                msg(json!({"start": {"process": {"tag": "cat-in"}}})),
                msg(json!({"start": {"process": {"tag": "cat-in"}}})),
            ]
            .concat(),
            "invalid_argument",
        ),
        (
            msg(json!({"start": {"process": {"pid": 999999}}})),
            "not_found",
        ),
        (
            msg(json!({"start": {"process": {"tag": "cat-in"}}}))[..7].to_vec(),
            "invalid_argument",
        ),
        (Vec::new(), "invalid_argument"),
    ] {
        let (s, _, b) = env.send(input(body)).await;
        assert_eq!(s, StatusCode::OK);
        let (_, end) = json_stream(&b);
        assert_eq!(end["error"]["code"], code, "{end}");
    }
}

/// A template built from an image, a Dockerfile or an E2B build keeps its user: requests
/// that name none run as it (E2B's defaults); `root` is still root.
#[tokio::test(flavor = "multi_thread")]
async fn requests_without_a_user_run_as_the_templates_user() {
    let env = setup("template-user");
    // The template now says `USER 4242:4242` (an image's, say).
    let tpl = env
        .dir
        .parent()
        .unwrap()
        .join("templates")
        .join(TEMPLATE)
        .join("template.json");
    let mut t: Value = serde_json::from_slice(&std::fs::read(&tpl).unwrap()).unwrap();
    t["image"] =
        json!({"reference": "test", "env": {}, "cwd": "", "user": "4242:4242", "start_cmd": []});
    std::fs::write(&tpl, serde_json::to_vec(&t).unwrap()).unwrap();
    let id_u = |auth: Option<&str>| {
        let mut r = env.req(
            "POST",
            "/process.Process/Start",
            Some("application/connect+json"),
            start_json("id -u; cd && pwd", false),
        );
        if let Some(a) = auth {
            r.headers_mut().insert("authorization", a.parse().unwrap());
        }
        r
    };
    let (s, _, body) = env.send(id_u(None)).await;
    assert_eq!(s, StatusCode::OK);
    let (events, _) = json_stream(&body);
    let out = String::from_utf8(collect_output(&events, "stdout")).unwrap();
    assert_eq!(out, "4242\n/\n", "{out} {events:?}");
    // root, by name.
    let (_, _, body) = env.send(id_u(Some("Basic cm9vdDo="))).await;
    let (events, _) = json_stream(&body);
    let out = String::from_utf8(collect_output(&events, "stdout")).unwrap();
    assert_eq!(out, "0\n/root\n", "{out}");
}
