//! Names the commit a binary was built from, for `levee --version`: an operator upgrading a
//! fleet tells an old binary from a new one by it (both said "0.1.0").

use std::process::Command;

fn main() {
    // Built again when the checkout moves to another commit (HEAD names a branch whose ref
    // file, or the packed refs, change with each commit).
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        println!("cargo:rerun-if-changed={path}");
    }
    let commit = Command::new("git")
        .args(["rev-parse", "--short=9", "HEAD"])
        .output()
        .ok()
        .filter(|output| output.status.success())
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map(|commit| commit.trim().to_string())
        .filter(|commit| !commit.is_empty());
    // A source tree without git (a tarball) says so rather than guessing.
    println!(
        "cargo:rustc-env=LEVEE_COMMIT={}",
        commit.as_deref().unwrap_or("unknown commit")
    );
}
