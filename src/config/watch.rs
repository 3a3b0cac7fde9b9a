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

#[derive(Debug, PartialEq, Eq)]
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
        if let Some(signal) = signal_of(event, &watched_dir) {
            let _ = sender.send(signal);
        }
    })?;
    watcher.watch(dir, RecursiveMode::NonRecursive)?;
    Ok(watcher)
}

/// What an event on the watched directory means for the policy; `None`: nothing.
fn signal_of(event: notify::Result<notify::Event>, watched_dir: &Path) -> Option<WatchSignal> {
    let event = match event {
        Err(_) => return Some(WatchSignal::Broken),
        Ok(event) => event,
    };
    // The kernel's queue of events overflowed (inotify's IN_Q_OVERFLOW): events were lost,
    // a policy file's among them perhaps. The event names no path; read the directory again.
    if event.need_rescan() {
        return Some(WatchSignal::Changed);
    }
    if matches!(event.kind, EventKind::Access(_)) {
        return None;
    }
    // Anything that happens to the directory itself (removed, or moved away as in
    // `mv policies policies.old; mv policies.new policies`) leaves the watch on the old one:
    // set it up again on the path.
    if event.paths.iter().any(|path| path == watched_dir) {
        Some(WatchSignal::Broken)
    } else if event
        .paths
        .iter()
        .any(|path| is_policy_file(path) || is_swapped_link(path))
    {
        Some(WatchSignal::Changed)
    } else {
        None
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{CreateKind, Flag};

    #[test]
    fn lost_events_mean_the_directory_is_read_again() {
        let dir = Path::new("/policies");
        let event = |kind, path: Option<&str>| {
            let event = notify::Event::new(kind);
            Ok(match path {
                Some(path) => event.add_path(dir.join(path)),
                None => event,
            })
        };
        // An overflow names no path: before, it was taken for nothing to do.
        let overflow = Ok(notify::Event::new(EventKind::Other).set_flag(Flag::Rescan));
        assert_eq!(signal_of(overflow, dir), Some(WatchSignal::Changed));
        let created = EventKind::Create(CreateKind::File);
        assert_eq!(
            signal_of(event(created, Some("levee.toml")), dir),
            Some(WatchSignal::Changed)
        );
        assert_eq!(
            signal_of(event(created, Some(".levee.toml.swp")), dir),
            None
        );
        assert_eq!(signal_of(event(EventKind::Other, None), dir), None);
        assert_eq!(
            signal_of(Ok(notify::Event::new(created).add_path(dir.into())), dir),
            Some(WatchSignal::Broken)
        );
    }
}
