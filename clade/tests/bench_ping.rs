//! `clade bench ping`: boots the native test guest with virtio-vsock and measures agent
//! round trips through `vmm::agent::Client`; by default the guest built into `clade`.

#[path = "../../tests/src/native_guest.rs"]
mod native_guest;

use std::process::Command;

use native_guest::native_guest;

#[test]
fn bench_ping_measures_round_trips_and_prints_one_json_object() {
    let o = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args([
            "bench", "ping", "--n", "200", "--warmup", "10", "--json", "--guest",
        ])
        .arg(native_guest())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(stdout.lines().count(), 1, "one JSON object: {stdout}");
    let j: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(j["name"], "agent_ping_rtt");
    assert_eq!(j["n"], 200);
    let (p50, p99) = (j["p50_us"].as_f64().unwrap(), j["p99_us"].as_f64().unwrap());
    assert!(p50 > 0.0 && p50 <= p99, "{j}");
    assert!(j["min_us"].as_f64().unwrap() <= p50, "{j}");
}

#[test]
fn bench_ping_uses_the_built_in_guest_without_guest_option() {
    let o = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(["bench", "ping", "--json", "-n", "50"])
        // An inherited override would defeat the point of this test.
        .env_remove("CLADE_NATIVE_GUEST")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let j: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(j["n"], 50);
    let p50 = j["p50_us"]
        .as_f64()
        .unwrap_or_else(|| panic!("numeric p50_us: {j}"));
    assert!(p50 > 0.0, "{j}");
}

#[test]
fn bench_ping_with_a_missing_guest_is_a_one_line_error() {
    let o = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(["bench", "ping", "--guest", "/nonexistent/native-guest"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("not found"), "{stderr}");
}
