//! Where log lines go: to stderr, written by a thread of their own, never by the tasks that
//! serve requests.
//!
//! stderr is whatever the service manager gave levee: a file on a disk that fills up, a pipe
//! to a logger that stalls or exits. Written in place, a pipe nobody read blocked the task
//! that logged, then every worker thread (no request answered, `/livez` silent, SIGTERM
//! unheeded), and a failed write panicked the task that logged (a connection dropped after
//! its answer, a sync loop gone for good). Here a line is handed to the writer thread
//! through a bounded queue; when the queue is full the line is dropped and counted, and the
//! count is said once lines go through again. Losing log lines is better than losing
//! visitors' requests.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Lines waiting for the writer at most: ~500 KB at an access line's ~250 bytes. (The queue's
/// slots are allocated at start: 8192 of them added 2 MB to an idle levee's memory.)
const QUEUE_LINES: usize = 2048;

/// The writer thread's stack: it writes lines and formats one of its own now and then. The
/// default 2 MiB became a whole huge page of resident memory where the kernel backs stacks
/// with them (transparent huge pages).
const WRITER_STACK_BYTES: usize = 128 * 1024;

enum Message {
    Line(Vec<u8>),
    /// Answered once every line before it was written (or given up on).
    Flush(SyncSender<()>),
}

/// The lines the writer never wrote: dropped with the queue full, or refused by stderr.
#[derive(Default)]
struct Lost {
    queue_full: AtomicU64,
    write_failed: AtomicU64,
    /// The last write error, for the line that says lines were lost.
    last_error: Mutex<Option<String>>,
}

/// The log's writer: give it to `tracing_subscriber::fmt().with_writer(…)`.
#[derive(Clone)]
pub struct LogWriter {
    sender: SyncSender<Message>,
    lost: Arc<Lost>,
}

impl LogWriter {
    /// Starts the writer thread, writing to `out` (stderr in levee); `json` picks the form of
    /// the writer's own line about lost lines, to match the log's.
    pub fn start(out: impl Write + Send + 'static, json: bool) -> LogWriter {
        let (sender, receiver) = sync_channel(QUEUE_LINES);
        let lost = Arc::new(Lost::default());
        let writer_lost = lost.clone();
        let started = std::thread::Builder::new()
            .name("levee-log".into())
            .stack_size(WRITER_STACK_BYTES)
            .spawn(move || write_lines(receiver, out, &writer_lost, json));
        if started.is_err() {
            // No thread: the queue fills and every line is counted as lost, which is still
            // better than a log that blocks the request path.
            lost.queue_full.fetch_add(1, Ordering::Relaxed);
        }
        LogWriter { sender, lost }
    }

    /// Waits up to `within` for the lines logged so far to be written: before the process
    /// exits, so its last lines ("levee stopped", why it could not start) are not lost, and
    /// never longer, so a stalled stderr cannot hold the exit up.
    pub fn flush(&self, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        let (done, written) = sync_channel(1);
        let mut flush = Message::Flush(done);
        // Queued behind the lines waiting (a full queue is tried again until the deadline).
        loop {
            match self.sender.try_send(flush) {
                Ok(()) => break,
                Err(TrySendError::Full(again)) if std::time::Instant::now() < deadline => {
                    flush = again;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return,
            }
        }
        let _ = written.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()));
    }

    /// Lines lost so far: dropped with the queue full, and refused by stderr.
    pub fn lost(&self) -> (u64, u64) {
        (
            self.lost.queue_full.load(Ordering::Relaxed),
            self.lost.write_failed.load(Ordering::Relaxed),
        )
    }
}

fn write_lines(receiver: Receiver<Message>, mut out: impl Write, lost: &Lost, json: bool) {
    // What was lost and already said, so each line about it tells only what is new.
    let (mut said_full, mut said_failed) = (0, 0);
    // A write that failed may have left part of its line (a disk filled midway): the next
    // line starts on a line of its own, or it was glued to the cut one (a JSON line no
    // collector could read, the one that says lines were lost).
    let mut mid_line = false;
    for message in receiver {
        let line = match message {
            Message::Line(line) => line,
            Message::Flush(done) => {
                let _ = out.flush();
                let _ = done.try_send(());
                continue;
            }
        };
        let full = lost.queue_full.load(Ordering::Relaxed);
        let failed = lost.write_failed.load(Ordering::Relaxed);
        if full > said_full || failed > said_failed {
            let error = lost
                .last_error
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone();
            let notice = lost_notice(full - said_full, failed - said_failed, error, json);
            let notice = if mid_line {
                format!("\n{notice}")
            } else {
                notice
            };
            if out.write_all(notice.as_bytes()).is_ok() {
                (said_full, said_failed) = (full, failed);
                mid_line = false;
            }
        }
        if mid_line && out.write_all(b"\n").is_ok() {
            mid_line = false;
        }
        if let Err(error) = out.write_all(&line) {
            mid_line = true;
            lost.write_failed.fetch_add(1, Ordering::Relaxed);
            *lost
                .last_error
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(error.to_string());
        }
    }
}

/// The writer's own line about lines it lost, in the log's form.
fn lost_notice(queue_full: u64, write_failed: u64, error: Option<String>, json: bool) -> String {
    let mut parts = Vec::new();
    if queue_full > 0 {
        parts.push(format!(
            "{queue_full} dropped while stderr took no more (a pipe nobody read, a slow disk)"
        ));
    }
    if write_failed > 0 {
        parts.push(format!(
            "{write_failed} refused by stderr ({})",
            error.as_deref().unwrap_or("a write error")
        ));
    }
    let message = format!(
        "log lines lost: {}; levee served on meanwhile",
        parts.join(", ")
    );
    let timestamp = utc_timestamp(std::time::SystemTime::now());
    if json {
        let line = serde_json::json!({
            "timestamp": timestamp,
            "level": "WARN",
            "target": "levee::log",
            "message": message,
            "dropped": queue_full,
            "refused": write_failed,
        });
        format!("{line}\n")
    } else {
        format!("{timestamp}  WARN levee::log: {message}\n")
    }
}

/// `2026-12-07T19:10:46.402117Z`, as the log's own lines stamp their time.
fn utc_timestamp(at: std::time::SystemTime) -> String {
    let since = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let seconds = since.as_secs();
    let (days, in_day) = (seconds / 86_400, seconds % 86_400);
    // Days since 1970-01-01 to a civil date (the proleptic Gregorian calendar).
    let shifted = days as i64 + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        in_day / 3600,
        in_day % 3600 / 60,
        in_day % 60,
        since.subsec_micros()
    )
}

/// One log line being formatted; handed to the writer thread whole when dropped.
pub struct LineWriter {
    line: Vec<u8>,
    writer: LogWriter,
}

impl Write for LineWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.line.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let line = std::mem::take(&mut self.line);
        match self.writer.sender.try_send(Message::Line(line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.writer.lost.queue_full.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter {
            line: Vec::with_capacity(256),
            writer: self.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stderr that blocks until told to go on (a pipe nobody reads), then takes lines.
    struct Stalled {
        go: Arc<(Mutex<bool>, std::sync::Condvar)>,
        taken: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Stalled {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let (lock, turn) = &*self.go;
            let mut go = lock.lock().expect("lock");
            while !*go {
                go = turn.wait(go).expect("wait");
            }
            self.taken.lock().expect("lock").extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn log(writer: &LogWriter, line: &str) {
        let mut made = tracing_subscriber::fmt::MakeWriter::make_writer(writer);
        made.write_all(line.as_bytes()).expect("write");
    }

    #[test]
    fn a_stalled_stderr_drops_lines_instead_of_blocking_and_says_so_later() {
        let go = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let taken = Arc::new(Mutex::new(Vec::new()));
        let writer = LogWriter::start(
            Stalled {
                go: go.clone(),
                taken: taken.clone(),
            },
            false,
        );
        // Far more than the queue holds: none of these calls blocks.
        for n in 0..QUEUE_LINES + 100 {
            log(&writer, &format!("line {n}\n"));
        }
        let (dropped, refused) = writer.lost();
        assert!(dropped >= 99, "{dropped}");
        assert_eq!(refused, 0);
        *go.0.lock().expect("lock") = true;
        go.1.notify_all();
        writer.flush(Duration::from_secs(10));
        log(&writer, "after\n");
        writer.flush(Duration::from_secs(10));
        let text = String::from_utf8(taken.lock().expect("lock").clone()).expect("text");
        let start: String = text.chars().take(80).collect();
        // The first line is written, before or after the notice (which comes first when the
        // writer had taken no line yet when the queue filled).
        assert!(
            text.starts_with("line 0\n") || text.contains("\nline 0\n"),
            "{start}"
        );
        assert!(
            text.contains("WARN levee::log: log lines lost: "),
            "no notice"
        );
        assert!(text.ends_with("after\n"));
    }

    #[test]
    fn the_notice_is_stamped_as_the_logs_lines_are() {
        let at = std::time::UNIX_EPOCH + Duration::from_micros(1_796_671_846_402_117);
        assert_eq!(utc_timestamp(at), "2026-12-07T19:30:46.402117Z");
        assert_eq!(
            utc_timestamp(std::time::UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00.000000Z"
        );
    }

    /// A disk that filled midway through a line, then took writes again.
    #[test]
    fn the_notice_after_a_cut_line_starts_a_line_of_its_own() {
        struct FillsOnce {
            taken: Arc<Mutex<Vec<u8>>>,
            writes: usize,
        }
        impl Write for FillsOnce {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.writes += 1;
                let mut taken = self.taken.lock().expect("lock");
                if self.writes == 2 {
                    // Half the line, then the disk is full.
                    taken.extend_from_slice(&bytes[..bytes.len() / 2]);
                    return Err(std::io::Error::other("No space left on device"));
                }
                taken.extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let taken = Arc::new(Mutex::new(Vec::new()));
        let writer = LogWriter::start(
            FillsOnce {
                taken: taken.clone(),
                writes: 0,
            },
            true,
        );
        for line in ["{\"n\":1}\n", "{\"n\":2}\n", "{\"n\":3}\n"] {
            log(&writer, line);
            writer.flush(Duration::from_secs(10));
        }
        let text = String::from_utf8(taken.lock().expect("lock").clone()).expect("text");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(lines[0], "{\"n\":1}");
        assert!(lines[1].starts_with("{\"n\""), "the cut line: {text}");
        let notice: serde_json::Value = serde_json::from_str(lines[2]).expect("a JSON line");
        assert_eq!(notice["refused"], 1);
        assert_eq!(lines[3], "{\"n\":3}");
    }

    #[test]
    fn a_failing_stderr_counts_its_refusals_and_says_them_in_the_logs_form() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("No space left on device"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let writer = LogWriter::start(Full, true);
        for _ in 0..3 {
            log(&writer, "line\n");
        }
        writer.flush(Duration::from_secs(10));
        assert_eq!(writer.lost(), (0, 3));
        let notice = lost_notice(0, 3, Some("No space left on device".into()), true);
        let parsed: serde_json::Value = serde_json::from_str(notice.trim()).expect("JSON");
        assert_eq!(parsed["refused"], 3);
        assert!(parsed["message"].as_str().is_some_and(
            |message| message.contains("3 refused by stderr (No space left on device)")
        ));
    }
}
