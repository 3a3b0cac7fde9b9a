//! Request bodies read whole before they go to php-fpm.
//!
//! php-fpm starts a script once it has the request's parameters, and PHP reads the body as
//! the script's input: a body that ends early (its client went away, or stopped sending past
//! `client_body_timeout`) is read as a short one, and the script runs on it, a form or an
//! upload cut in the middle applied as if it were whole. nginx reads the whole body before
//! it asks php-fpm (`fastcgi_request_buffering on`), and so does levee: in memory up to
//! [`IN_MEMORY`], the rest in a file without a name under the upstream's `temp_dir`. That
//! also keeps a client that uploads slowly from holding a php-fpm worker meanwhile.

use std::io::SeekFrom;
use std::path::Path;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWriteExt, ReadBuf};

use super::body::{BodyPieces, ResendableBody};
use super::upstream::UpstreamBody;
use crate::log_throttle::LogThrottle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Bytes of one body kept in memory; past this it goes to a file.
pub const IN_MEMORY: usize = 1024 * 1024;

/// Bytes read back from the file per frame when the body is sent.
const READ_BACK: usize = 64 * 1024;

/// Files that could not be made or written: at most one line a minute.
static FILE_TROUBLE_LOG: LogThrottle = LogThrottle::new(Duration::from_secs(60));

/// A body read whole.
pub enum Spooled {
    /// All of it in memory.
    InMemory(ResendableBody),
    /// All of it in a file (read from its start), `len` bytes.
    File { file: tokio::fs::File, len: u64 },
}

impl Spooled {
    /// The body to send, and the same again when it can be sent a second time (in memory).
    pub fn into_body(self) -> (UpstreamBody, Option<ResendableBody>) {
        match self {
            Spooled::InMemory(whole) => (whole.body(), Some(whole)),
            Spooled::File { file, len } => (
                FileBody {
                    file,
                    left: len,
                    failed: false,
                }
                .boxed_unsync(),
                None,
            ),
        }
    }
}

/// Bytes gathered before one write to the file: each write goes through the blocking pool,
/// and its result is waited for before its bytes count as kept.
const BATCH: usize = 256 * 1024;

/// Reads `body` to its end: in memory up to [`IN_MEMORY`], then in a file under `dir`. A
/// file that cannot be made or written (a full disk) leaves the body in memory (bounded by
/// the route's `max_body`, as before it was read), said in the log. The client's own failure
/// (gone, too slow, too long) is its error; one reading back levee's own file is a
/// [`SpoolError`].
pub async fn spool(mut body: UpstreamBody, dir: &Path) -> Result<Spooled, BoxError> {
    let mut pieces = BodyPieces::default();
    let mut file: Option<Spill> = None;
    // Once a file failed, the rest stays in memory.
    let mut files_fail = false;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue; // trailers: FastCGI has no place for them
        };
        if data.is_empty() {
            continue;
        }
        if file.is_none() && !files_fail && pieces.bytes_kept() + data.len() > IN_MEMORY {
            match Spill::create(dir).await {
                Ok(mut spill) => {
                    for piece in std::mem::take(&mut pieces).into_pieces() {
                        spill.batch.extend_from_slice(&piece);
                    }
                    file = Some(spill);
                }
                Err(error) => {
                    say_file_trouble(dir, &error);
                    files_fail = true;
                }
            }
        }
        let Some(spill) = file.as_mut() else {
            pieces.push(data);
            continue;
        };
        spill.batch.extend_from_slice(&data);
        if spill.batch.len() < BATCH {
            continue;
        }
        if let Err(error) = spill.write_batch().await {
            say_file_trouble(dir, &error);
            files_fail = true;
            if let Some(spill) = file.take() {
                pieces = BodyPieces::default();
                pieces.push(spill.into_memory().await?);
            }
        }
    }
    let Some(mut spill) = file else {
        return Ok(Spooled::InMemory(ResendableBody::from_pieces(
            pieces.into_pieces(),
        )));
    };
    // (`write_batch` waited for every write: the file is whole on disk; read it from its start.)
    let kept = match spill.write_batch().await {
        Ok(()) => spill.file.seek(SeekFrom::Start(0)).await.map(|_| ()),
        Err(error) => Err(error),
    };
    match kept {
        Ok(()) => Ok(Spooled::File {
            file: spill.file,
            len: spill.written,
        }),
        Err(error) => {
            say_file_trouble(dir, &error);
            Ok(Spooled::InMemory(ResendableBody::from_bytes(
                spill.into_memory().await?,
            )))
        }
    }
}

/// Reading back levee's own file of a request body failed: the body is lost to levee, not
/// to the client or the upstream (answered 500, not counted against the upstream).
#[derive(Debug, thiserror::Error)]
#[error("levee could not read back the request body it kept: {0}")]
pub struct SpoolError(std::io::Error);

/// A body's file, what of it is known written, and what waits to be.
struct Spill {
    file: tokio::fs::File,
    /// Bytes written and flushed: only these are read back.
    written: u64,
    batch: BytesMut,
}

impl Spill {
    /// A new file under `dir`, removed at once (it has no name: nothing is left behind, even
    /// if levee is killed). Its name is random: one left by a levee killed between making and
    /// removing it is never met again.
    async fn create(dir: &Path) -> std::io::Result<Spill> {
        let mut random = [0u8; 8];
        getrandom::getrandom(&mut random)
            .map_err(|error| std::io::Error::other(error.to_string()))?;
        let path = dir.join(format!(
            ".levee-body-{}-{:016x}",
            std::process::id(),
            u64::from_ne_bytes(random)
        ));
        let file = tokio::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .await?;
        if let Err(error) = tokio::fs::remove_file(&path).await {
            drop(file);
            let _ = tokio::fs::remove_file(&path).await;
            return Err(error);
        }
        Ok(Spill {
            file,
            written: 0,
            batch: BytesMut::new(),
        })
    }

    /// Writes the batch and waits for the write's own result (a full disk shows there).
    async fn write_batch(&mut self) -> std::io::Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        self.file.write_all(&self.batch).await?;
        self.file.flush().await?;
        self.written += self.batch.len() as u64;
        self.batch.clear();
        Ok(())
    }

    /// What was written, read back, followed by the batch not written.
    async fn into_memory(mut self) -> Result<Bytes, SpoolError> {
        let mut whole =
            Vec::with_capacity(usize::try_from(self.written).unwrap_or(0) + self.batch.len());
        let read = async {
            self.file.seek(SeekFrom::Start(0)).await?;
            (&mut self.file)
                .take(self.written)
                .read_to_end(&mut whole)
                .await
        };
        match read.await {
            Ok(read) if read as u64 == self.written => {}
            Ok(_) => {
                return Err(SpoolError(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "its file was cut short",
                )))
            }
            Err(error) => return Err(SpoolError(error)),
        }
        whole.extend_from_slice(&self.batch);
        Ok(Bytes::from(whole))
    }
}

fn say_file_trouble(dir: &Path, error: &std::io::Error) {
    if let Some(held_back) = FILE_TROUBLE_LOG.allow(std::time::Instant::now()) {
        tracing::warn!(
            dir = %dir.display(),
            "a request body over 1 MiB is kept in memory: its file in the upstream's temp_dir failed: {error} ({held_back} more not logged)"
        );
    }
}

/// A spooled body sent from its file.
struct FileBody {
    file: tokio::fs::File,
    left: u64,
    failed: bool,
}

impl Body for FileBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.left == 0 || this.failed {
            return Poll::Ready(None);
        }
        let want = usize::try_from(this.left).map_or(READ_BACK, |left| left.min(READ_BACK));
        let mut chunk = BytesMut::zeroed(want);
        let mut buf = ReadBuf::new(&mut chunk);
        if let Err(error) = ready!(Pin::new(&mut this.file).poll_read(cx, &mut buf)) {
            this.failed = true;
            return Poll::Ready(Some(Err(error.into())));
        }
        let read = buf.filled().len();
        if read == 0 {
            this.failed = true;
            return Poll::Ready(Some(Err("the request body's file was cut short".into())));
        }
        chunk.truncate(read);
        this.left -= read as u64;
        Poll::Ready(Some(Ok(Frame::data(chunk.freeze()))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream;
    use http_body_util::StreamBody;

    fn body_of(pieces: Vec<Result<Bytes, &'static str>>) -> UpstreamBody {
        StreamBody::new(stream::iter(pieces.into_iter().map(|piece| {
            piece
                .map(Frame::data)
                .map_err(|error| -> BoxError { error.into() })
        })))
        .boxed_unsync()
    }

    async fn sent(body: UpstreamBody) -> Vec<u8> {
        body.collect().await.expect("whole").to_bytes().to_vec()
    }

    #[tokio::test]
    async fn a_small_body_stays_in_memory_and_a_large_one_goes_to_a_file_without_a_name() {
        let dir = tempfile::tempdir().expect("dir");
        let small = spool(
            body_of(vec![Ok(Bytes::from_static(b"a=1&b=2"))]),
            dir.path(),
        )
        .await
        .expect("spooled");
        assert!(matches!(small, Spooled::InMemory(_)));
        let (body, resend) = small.into_body();
        assert_eq!(sent(body).await, b"a=1&b=2");
        assert!(resend.is_some());

        let piece = Bytes::from(vec![b'x'; 300 * 1024]);
        let large = spool(body_of(vec![Ok(piece.clone()); 5]), dir.path())
            .await
            .expect("spooled");
        assert!(matches!(large, Spooled::File { len, .. } if len == 5 * 300 * 1024));
        // Nothing left in the directory: the file has no name.
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
        let (body, resend) = large.into_body();
        assert!(resend.is_none());
        assert_eq!(body.size_hint().exact(), Some(5 * 300 * 1024));
        let whole = sent(body).await;
        assert_eq!(whole.len(), 5 * 300 * 1024);
        assert!(whole.iter().all(|byte| *byte == b'x'));
    }

    #[tokio::test]
    async fn a_write_the_disk_refuses_counts_nothing_and_its_bytes_come_back_to_memory() {
        // /dev/full refuses every write as a full disk does (ENOSPC), which tokio reports
        // only once the write has run: a batch counts as written after its flush.
        let Ok(full) = tokio::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/full")
            .await
        else {
            return;
        };
        let mut spill = Spill {
            file: full,
            written: 0,
            batch: BytesMut::from(&[b'z'; 300 * 1024][..]),
        };
        assert!(spill.write_batch().await.is_err());
        assert_eq!(spill.written, 0);
        let back = spill.into_memory().await.expect("back in memory");
        assert_eq!(back.len(), 300 * 1024);
        assert!(back.iter().all(|byte| *byte == b'z'));
    }

    #[tokio::test]
    async fn a_body_whose_client_fails_is_an_error_and_without_a_directory_stays_in_memory() {
        let dir = tempfile::tempdir().expect("dir");
        let piece = Bytes::from(vec![b'y'; 700 * 1024]);
        let failed = spool(
            body_of(vec![
                Ok(piece.clone()),
                Ok(piece.clone()),
                Err("client gone"),
            ]),
            dir.path(),
        )
        .await;
        assert!(failed.is_err());
        let missing = dir.path().join("missing");
        let kept = spool(body_of(vec![Ok(piece.clone()), Ok(piece)]), &missing)
            .await
            .expect("spooled");
        assert!(matches!(kept, Spooled::InMemory(_)));
        assert_eq!(sent(kept.into_body().0).await.len(), 1400 * 1024);
    }
}
