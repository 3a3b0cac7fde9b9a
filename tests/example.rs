//! The example site end to end: `examples/run-demo.sh --check` starts Redis, php-fpm, the AI
//! stand-in, levee and the repository's nginx.conf on free loopback ports, runs its self-test
//! through the front nginx (homepage, ranking hidden and served stale, queued notification
//! replayed, AI fallback while the AI API fails, login limit) and stops everything.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The whole check takes a few seconds; this only bounds a hang.
const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn run_demo_check_passes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let log_path = dir.path().join("run-demo.out");
    let log = std::fs::File::create(&log_path).expect("output file");
    let mut child = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/run-demo.sh"))
        .arg("--check")
        // The binary cargo built for this test run: no release build inside the test.
        .env("LEVEE_BIN", env!("CARGO_BIN_EXE_levee"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("output file"))
        .stderr(log)
        .spawn()
        .expect("run bash examples/run-demo.sh --check");

    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for run-demo.sh") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let status = status.unwrap_or_else(|| {
        // Too slow: SIGTERM lets the script's trap stop what it started, then SIGKILL.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let grace = Instant::now() + Duration::from_secs(15);
        while Instant::now() < grace {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        let output = std::fs::read_to_string(&log_path).unwrap_or_default();
        panic!("run-demo.sh --check did not finish within {LIMIT:?}:\n{output}");
    });

    let output = std::fs::read_to_string(&log_path).expect("read output");
    assert!(
        status.success(),
        "run-demo.sh --check failed ({status}):\n{output}"
    );
    assert!(output.contains("self-test passed"), "{output}");
    assert!(!output.contains("FAIL"), "{output}");
}
