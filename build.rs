//! Names the commit a binary was built from, for `levee --version`: an operator upgrading a
//! fleet tells an old binary from a new one by it (both said "0.1.0").

use std::path::PathBuf;
use std::process::Command;

/// `git` with `args`, its output trimmed; `None` without git, outside a checkout, or empty.
fn git(args: &[&str]) -> Option<String> {
    Command::new("git")
        .args(args)
        .output()
        .ok()
        .filter(|output| output.status.success())
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map(|text| text.trim().to_string())
        .filter(|text| !text.is_empty())
}

fn main() {
    // Run again only when the commit may have moved: a path cargo is told to watch that does
    // not exist (no packed refs yet) made it run this script, and build levee anew, on every
    // build.
    println!("cargo:rerun-if-changed=build.rs");
    if let Some(git_dir) = git(&["rev-parse", "--git-dir"]).map(PathBuf::from) {
        let mut watched = vec![git_dir.join("HEAD"), git_dir.join("packed-refs")];
        // The branch HEAD names, whose ref file a commit rewrites.
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(git_dir.join(branch));
        }
        for path in watched.iter().filter(|path| path.exists()) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    // A source tree without git (a tarball) says so rather than guessing.
    let commit = git(&["rev-parse", "--short=9", "HEAD"]);
    println!(
        "cargo:rustc-env=LEVEE_COMMIT={}",
        commit.as_deref().unwrap_or("unknown commit")
    );
}
