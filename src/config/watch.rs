//! Watches the policy directory and reloads when files change.
//!
//! The directory is watched, not the files, so an editor's write-to-temp-then-rename is seen.
//! Events are debounced until the directory has been quiet for a moment, so a save that
//! touches the file several times causes one reload; a file written in place (truncated,
//! then written) is read once it is closed, not in between, where what is left of it may
//! still compile and would drop the routes and limits of its missing part. A bad file never
//! stops the watcher. If the watch itself breaks, or the path comes to name another directory
//! (moved or swapped into place, deleted and made again, a symlink switched to another
//! target), it is set up again on the path, and what is there then is loaded.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RenameMode};
use notify::{EventKind, RecursiveMode, Watcher};
use std::os::unix::fs::MetadataExt;
use tokio::sync::{mpsc, watch};

use super::compile::{EMPTIED_LATELY, EMPTIED_MESSAGE};
use super::store::{PolicyStore, ReloadTrigger};

/// How long the directory must be quiet before a reload. Default 200ms.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(200);

/// How long a file written in place may stay open, quiet, before it is read as it is: a
/// writer that holds it open without writing (or a truncation by path, which no close
/// follows) must not hold its reload back for ever.
pub(super) const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// How often the watcher checks that the path still names the directory it watches. A
/// directory moved or swapped into place, or a symlink switched, gives the old watch no event
/// that says so on every system; a `stat` a second costs nothing.
const IDENTITY_CHECK: Duration = Duration::from_secs(1);

#[derive(Debug, PartialEq, Eq)]
enum WatchSignal {
    Changed,
    /// A policy file is being written in place (opened for writing, written, created).
    Writing(PathBuf),
    /// A policy file opened for writing was closed.
    Closed(PathBuf),
    /// A file was renamed within the directory: one open for writing is closed under its new
    /// name.
    Renamed {
        from: PathBuf,
        to: PathBuf,
    },
    Broken,
}

/// Which directory a path names now: its device and inode, through symlinks.
fn identity_of(dir: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(dir)
        .ok()
        .map(|metadata| identity(&metadata))
}

/// [`identity_of`] off the runtime's threads: on a network mount a `stat` may block.
async fn identity_now(dir: &Path) -> Option<(u64, u64)> {
    tokio::fs::metadata(dir)
        .await
        .ok()
        .map(|metadata| identity(&metadata))
}

/// What the policy files that are symlinks point at look like now (device, inode, size,
/// modification time of each target), in file order. A symlink's target outside the directory
/// (config management keeps the file elsewhere and links it in) gives the directory's watch
/// no event when it is edited or replaced, so it is looked at on each identity check instead.
type LinkedStamp = Vec<(PathBuf, Option<(u64, u64, u64, i64, i64)>)>;

fn linked_targets(dir: &Path) -> LinkedStamp {
    let Ok(paths) = super::compile::policy_file_paths(dir) else {
        return Vec::new();
    };
    paths
        .into_iter()
        .filter(|path| std::fs::symlink_metadata(path).is_ok_and(|meta| meta.is_symlink()))
        .map(|path| {
            let stamp = std::fs::metadata(&path).ok().map(|meta| {
                (
                    meta.dev(),
                    meta.ino(),
                    meta.size(),
                    meta.mtime(),
                    meta.mtime_nsec(),
                )
            });
            (path, stamp)
        })
        .collect()
}

/// [`linked_targets`] off the runtime's threads.
async fn linked_targets_now(dir: &Path) -> LinkedStamp {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || linked_targets(&dir))
        .await
        .unwrap_or_default()
}

fn identity(metadata: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt as _;
    (metadata.dev(), metadata.ino())
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
    let mut first = Some((identity_of(store.dir()), watch_dir(&store)));
    tokio::spawn(async move {
        loop {
            let (watched, attempt) = match first.take() {
                Some(first) => first,
                None => (identity_of(store.dir()), watch_dir(&store)),
            };
            let (watcher, mut events) = match attempt {
                Ok(watching) => {
                    if store.note_watch_problem(None) {
                        tracing::info!(dir = %store.dir().display(), "policy directory watched again");
                    }
                    watching
                }
                Err(error) => {
                    // Said once, and shown in `/status` while it lasts: every 2 s, the line
                    // buried the log of the incident that took the directory away.
                    // The watch library's words for a missing path ("No path was found.
                    // about [...]") are not an operator's.
                    let problem = if std::fs::metadata(store.dir()).is_err() {
                        "cannot watch the policy directory (it does not exist now)".to_string()
                    } else {
                        format!("cannot watch the policy directory ({error})")
                    };
                    if store.note_watch_problem(Some(problem.clone())) {
                        tracing::warn!(dir = %store.dir().display(), "{problem}; edits are not read until it can be, tried every 2 s");
                    } else {
                        tracing::debug!(dir = %store.dir().display(), "{problem}; retrying");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(2)) => continue,
                        _ = stop.wait_for(|stopped| *stopped) => return,
                    }
                }
            };
            // What is there now is read once the watch is set up, first or again: the files
            // may have changed since they were last read (an edit saved while levee started,
            // the directory replaced). Only now, so an edit made meanwhile is either read then
            // or seen by the watch; and through the debounce, so a directory still being
            // filled (copied, cloned) is read once its writers are done, never half.
            let mut look_now = Some(WatchSignal::Changed);
            let mut identity_check = tokio::time::interval(IDENTITY_CHECK);
            identity_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The linked files' targets as last read, and as seen at the last check: a change
            // is read once it has held still for a check (a target still being written is
            // not read half).
            let mut linked_read = linked_targets_now(store.dir()).await;
            let mut linked_seen = linked_read.clone();
            // Policy files opened for writing and not closed yet.
            let mut writing = HashSet::new();
            store.note_being_written(Vec::new());
            // A reload refused for a file found emptied is tried again once the file has
            // stayed empty long enough to be meant so (no event may come to say it).
            let mut look_again_at: Option<tokio::time::Instant> = None;
            loop {
                // `None`: the time to check the directory's identity.
                let woke = match look_now.take() {
                    Some(signal) => Some(Some(signal)),
                    None => tokio::select! {
                        signal = events.recv() => Some(signal),
                        _ = identity_check.tick() => None,
                        _ = sleep_until_some(look_again_at) => {
                            look_again_at = None;
                            Some(Some(WatchSignal::Changed))
                        }
                        _ = stop.wait_for(|stopped| *stopped) => return,
                    },
                };
                let signal = match woke {
                    Some(signal) => signal,
                    None if identity_now(store.dir()).await == watched => {
                        let linked = linked_targets_now(store.dir()).await;
                        let settled = linked == linked_seen;
                        linked_seen = linked;
                        if !settled || linked_seen == linked_read {
                            continue;
                        }
                        linked_read = linked_seen.clone();
                        Some(WatchSignal::Changed)
                    }
                    None => Some(WatchSignal::Broken),
                };
                match signal {
                    Some(WatchSignal::Broken) | None => break,
                    Some(signal) => {
                        note(&mut writing, signal);
                        publish(&store, &writing);
                        // Debounce: wait until no event has come for `debounce`, and no file
                        // is left open for writing (for up to CLOSE_WAIT of quiet).
                        let mut broken = false;
                        loop {
                            let quiet = if writing.is_empty() {
                                debounce
                            } else {
                                CLOSE_WAIT
                            };
                            match tokio::time::timeout(quiet, events.recv()).await {
                                Ok(Some(WatchSignal::Broken)) | Ok(None) => {
                                    broken = true;
                                    break;
                                }
                                Ok(Some(signal)) => {
                                    note(&mut writing, signal);
                                    publish(&store, &writing);
                                }
                                Err(_quiet) => {
                                    if !writing.is_empty() {
                                        tracing::warn!(files = ?writing, "a policy file written in place was left open, unchanged, for {CLOSE_WAIT:?}; reading it as it is");
                                        writing.clear();
                                        publish(&store, &writing);
                                    }
                                    break;
                                }
                            }
                        }
                        if broken {
                            break;
                        }
                        // Errors are logged, counted and kept by the store.
                        let refused = store.reload(ReloadTrigger::Watch).await.err();
                        look_again_at = refused
                            .filter(|errors| {
                                errors
                                    .0
                                    .iter()
                                    .any(|error| error.message == EMPTIED_MESSAGE)
                            })
                            .map(|_| {
                                tokio::time::Instant::now()
                                    + EMPTIED_LATELY
                                    + Duration::from_secs(1)
                            });
                    }
                }
            }
            drop(watcher);
            tracing::warn!(dir = %store.dir().display(), "policy directory watch was lost, or the path names another directory now; setting it up again");
        }
    })
}

/// Sleeps until `at`, or for ever when there is none.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Tells the store which policy files are open for writing (see
/// `PolicyStore::note_being_written`), in order.
fn publish(store: &PolicyStore, writing: &HashSet<PathBuf>) {
    let mut files: Vec<PathBuf> = writing.iter().cloned().collect();
    files.sort();
    store.note_being_written(files);
}

/// Keeps `writing` (the files open for writing) up to date with a signal.
fn note(writing: &mut HashSet<PathBuf>, signal: WatchSignal) {
    match signal {
        WatchSignal::Writing(path) => {
            writing.insert(path);
        }
        WatchSignal::Closed(path) => {
            writing.remove(&path);
        }
        WatchSignal::Renamed { from, to } => {
            if writing.remove(&from) && is_policy_file(&to) {
                writing.insert(to);
            }
        }
        WatchSignal::Changed | WatchSignal::Broken => {}
    }
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
    let policy_file = || {
        event
            .paths
            .iter()
            .find(|path| is_policy_file(path))
            .cloned()
    };
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {
            return policy_file().map(WatchSignal::Closed)
        }
        EventKind::Access(_) => return None,
        _ => {}
    }
    // The pair of a rename within the directory (its two halves came before, each a change).
    if let (EventKind::Modify(ModifyKind::Name(RenameMode::Both)), [from, to]) =
        (event.kind, event.paths.as_slice())
    {
        let ours = is_policy_file(from) || is_policy_file(to);
        if ours && from != watched_dir && to != watched_dir {
            return Some(WatchSignal::Renamed {
                from: from.clone(),
                to: to.clone(),
            });
        }
    }
    // Anything that happens to the directory itself (removed, or moved away as in
    // `mv policies policies.old; mv policies.new policies`) leaves the watch on the old one:
    // set it up again on the path. Not a change of its times or mode (`touch`, `chmod`, and
    // every `rsync -a` into it), which leaves the watch as it was: taken as lost, it was set
    // up again with a warning that alerting on warnings pages someone for.
    if event.paths.iter().any(|path| path == watched_dir) {
        if matches!(event.kind, EventKind::Modify(ModifyKind::Metadata(_))) {
            return None;
        }
        return Some(WatchSignal::Broken);
    }
    // Written in place, or made (and so open for writing) — a symlink made is none of these.
    // Only Linux's inotify tells when a file written is closed; elsewhere a write is a
    // change like any other.
    let created_file = matches!(event.kind, EventKind::Create(CreateKind::File));
    let written = cfg!(target_os = "linux")
        && (created_file || matches!(event.kind, EventKind::Modify(ModifyKind::Data(_))));
    if let Some(path) = policy_file() {
        // A symlink, or a hard link to a file already there (`ln`), is made without being
        // opened: no close follows it.
        let is_link = std::fs::symlink_metadata(&path)
            .is_ok_and(|meta| meta.is_symlink() || (created_file && meta.nlink() > 1));
        return Some(if written && !is_link {
            WatchSignal::Writing(path)
        } else {
            WatchSignal::Changed
        });
    }
    // `limits.TOML` saved: not read, which the reload's warning says (else not a word until
    // the next reload, and its rules silently missing).
    event
        .paths
        .iter()
        .any(|path| is_swapped_link(path) || is_named_like_a_policy(path))
        .then_some(WatchSignal::Changed)
}

/// A file of the directory that is no policy file but looks meant as one.
fn is_named_like_a_policy(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| {
            !name.starts_with('.')
                && super::compile::named_like_a_policy(&name.to_ascii_lowercase())
        })
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
            Some(WatchSignal::Writing(dir.join("levee.toml")))
        );
        let closed = EventKind::Access(AccessKind::Close(AccessMode::Write));
        assert_eq!(
            signal_of(event(closed, Some("levee.toml")), dir),
            Some(WatchSignal::Closed(dir.join("levee.toml")))
        );
        let renamed = EventKind::Modify(ModifyKind::Name(notify::event::RenameMode::To));
        assert_eq!(
            signal_of(event(renamed, Some("levee.toml")), dir),
            Some(WatchSignal::Changed)
        );
        assert_eq!(
            signal_of(event(created, Some("..data_tmp")), dir),
            Some(WatchSignal::Changed)
        );
        assert_eq!(
            signal_of(event(created, Some(".levee.toml.swp")), dir),
            None
        );
        assert_eq!(signal_of(event(EventKind::Other, None), dir), None);
        let both = EventKind::Modify(ModifyKind::Name(RenameMode::Both));
        let pair = |from: &str, to: &str| {
            Ok(notify::Event::new(both)
                .add_path(dir.join(from))
                .add_path(dir.join(to)))
        };
        assert_eq!(
            signal_of(pair("new.toml", "levee.toml"), dir),
            Some(WatchSignal::Renamed {
                from: dir.join("new.toml"),
                to: dir.join("levee.toml")
            })
        );
        assert_eq!(signal_of(pair("a.tmp", "b.tmp"), dir), None);
        assert_eq!(
            signal_of(pair("..data_tmp", "..data"), dir),
            Some(WatchSignal::Changed)
        );
        assert_eq!(
            signal_of(Ok(notify::Event::new(created).add_path(dir.into())), dir),
            Some(WatchSignal::Broken)
        );
        let touched = EventKind::Modify(ModifyKind::Metadata(notify::event::MetadataKind::Any));
        assert_eq!(
            signal_of(Ok(notify::Event::new(touched).add_path(dir.into())), dir),
            None
        );
        let moved_away = EventKind::Modify(ModifyKind::Name(RenameMode::Any));
        assert_eq!(
            signal_of(Ok(notify::Event::new(moved_away).add_path(dir.into())), dir),
            Some(WatchSignal::Broken)
        );
    }

    /// A file renamed while open for writing is closed under its new name: its reload waits
    /// for that close, not for `CLOSE_WAIT`.
    #[test]
    fn a_file_open_for_writing_is_followed_through_a_rename() {
        let dir = Path::new("/policies");
        let mut writing = HashSet::new();
        note(&mut writing, WatchSignal::Writing(dir.join("new.toml")));
        note(
            &mut writing,
            WatchSignal::Renamed {
                from: dir.join("new.toml"),
                to: dir.join("levee.toml"),
            },
        );
        assert_eq!(writing, HashSet::from([dir.join("levee.toml")]));
        note(&mut writing, WatchSignal::Closed(dir.join("levee.toml")));
        assert!(writing.is_empty());
        // Renamed away from a policy name: no longer a policy file being written.
        note(&mut writing, WatchSignal::Writing(dir.join("levee.toml")));
        note(
            &mut writing,
            WatchSignal::Renamed {
                from: dir.join("levee.toml"),
                to: dir.join("levee.toml~"),
            },
        );
        assert!(writing.is_empty());
    }

    /// A hard link made to a policy file (`ln`) is not a file opened for writing: no close
    /// follows it, so it is a change like a symlink made.
    #[test]
    fn a_hard_link_made_is_a_change_not_a_write() {
        let dir = tempfile::tempdir().expect("dir");
        let made = dir.path().join("made.toml");
        std::fs::write(&made, "").expect("write");
        let created =
            |path: &Path| {
                Ok(notify::Event::new(EventKind::Create(CreateKind::File))
                    .add_path(path.to_path_buf()))
            };
        assert_eq!(
            signal_of(created(&made), dir.path()),
            Some(WatchSignal::Writing(made.clone()))
        );
        let linked = dir.path().join("linked.toml");
        std::fs::hard_link(&made, &linked).expect("link");
        assert_eq!(
            signal_of(created(&linked), dir.path()),
            Some(WatchSignal::Changed)
        );
    }
}
