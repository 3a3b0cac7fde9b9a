//! Watches the policy directory and reloads when files change.
//!
//! The directory is watched, not the files, so an editor's write-to-temp-then-rename is seen.
//! Events are debounced until the directory has been quiet for a moment, so a save that
//! touches the file several times causes one reload. A bad file never stops the watcher;
//! if the watch itself breaks (the directory was removed, or replaced by another moved into
//! its place), it is set up again on the path, and what is there then is loaded.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};

use super::store::{PolicyStore, ReloadTrigger};

/// How long the directory must be quiet before a reload. Default 200ms.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(200);

enum WatchSignal {
    Changed,
    Broken,
}

/// Starts the watcher task; it lasts until `stop` turns true.
pub fn spawn_watcher(
    store: Arc<PolicyStore>,
    debounce: Duration,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    // The first watch is set up before this returns, not when the task first runs: a change
    // made right after levee started (an edit, or the directory swapped whole) is seen, where
    // a busy runtime could otherwise start the task after it and watch the new state only.
    let mut first = Some(watch_dir(&store));
    tokio::spawn(async move {
        let mut lost = false;
        loop {
            let attempt = match first.take() {
                Some(attempt) => attempt,
                None => watch_dir(&store),
            };
            let (watcher, mut events) = match attempt {
                Ok(watching) => watching,
                Err(error) => {
                    tracing::warn!(dir = %store.dir().display(), "cannot watch the policy directory ({error}); retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(2)) => continue,
                        _ = stop.wait_for(|stopped| *stopped) => return,
                    }
                }
            };
            if lost {
                // The directory may have been replaced: reload what is there now. Only now,
                // with the new watch set up, so an edit made meanwhile is either read here or
                // seen by the watch.
                let _ = store.reload(ReloadTrigger::Watch).await;
            }
            loop {
                let signal = tokio::select! {
                    signal = events.recv() => signal,
                    _ = stop.wait_for(|stopped| *stopped) => return,
                };
                match signal {
                    Some(WatchSignal::Changed) => {
                        // Debounce: wait until no event has come for `debounce`.
                        let mut broken = false;
                        loop {
                            match tokio::time::timeout(debounce, events.recv()).await {
                                Ok(Some(WatchSignal::Changed)) => {}
                                Ok(Some(WatchSignal::Broken)) | Ok(None) => {
                                    broken = true;
                                    break;
                                }
                                Err(_quiet) => break,
                            }
                        }
                        if broken {
                            break;
                        }
                        // Errors are logged, counted and kept by the store.
                        let _ = store.reload(ReloadTrigger::Watch).await;
                    }
                    Some(WatchSignal::Broken) | None => break,
                }
            }
            drop(watcher);
            tracing::warn!(dir = %store.dir().display(), "policy directory watch was lost; setting it up again");
            lost = true;
        }
    })
}

/// A watch on the store's directory and the channel its signals arrive on.
type Watching = (
    notify::RecommendedWatcher,
    mpsc::UnboundedReceiver<WatchSignal>,
);

fn watch_dir(store: &PolicyStore) -> notify::Result<Watching> {
    let (sender, events) = mpsc::unbounded_channel();
    start_watching(store.dir(), sender).map(|watcher| (watcher, events))
}

fn start_watching(
    dir: &Path,
    sender: mpsc::UnboundedSender<WatchSignal>,
) -> notify::Result<notify::RecommendedWatcher> {
    let watched_dir = dir.to_path_buf();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let signal = match event {
            Err(_) => WatchSignal::Broken,
            Ok(event) => {
                if matches!(event.kind, EventKind::Access(_)) {
                    return;
                }
                // Anything that happens to the directory itself (removed, or moved away as
                // in `mv policies policies.old; mv policies.new policies`) leaves the watch
                // on the old one: set it up again on the path.
                if event.paths.iter().any(|path| path == &watched_dir) {
                    WatchSignal::Broken
                } else if event
                    .paths
                    .iter()
                    .any(|path| is_policy_file(path) || is_swapped_link(path))
                {
                    WatchSignal::Changed
                } else {
                    return;
                }
            }
        };
        let _ = sender.send(signal);
    })?;
    watcher.watch(dir, RecursiveMode::NonRecursive)?;
    Ok(watcher)
}

/// Kubernetes mounts a ConfigMap as files linked through `..data`, which it swaps whole: the
/// `.toml` names never change, only that link does.
fn is_swapped_link(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.starts_with(".."))
}

/// Editors' swap and backup files (`.x.toml.swp`, `x.toml~`) are not policy files.
fn is_policy_file(path: &Path) -> bool {
    path.extension().is_some_and(|ext| ext == "toml")
        && path
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| !name.starts_with('.'))
}
