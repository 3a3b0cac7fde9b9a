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
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWriteExt, ReadBuf};

use super::body::ResendableBody;
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

/// Reads `body` to its end: in memory up to [`IN_MEMORY`], then in a file under `dir`. A
/// file that cannot be made or written leaves the body in memory (bounded by the route's
/// `max_body`, as before it was read), said in the log; only the client's own failure (gone,
/// too slow, too long) is an error.
pub async fn spool(mut body: UpstreamBody, dir: &Path) -> Result<Spooled, BoxError> {
    let mut pieces: Vec<Bytes> = Vec::new();
    let mut in_memory = 0usize;
    let mut file: Option<(tokio::fs::File, u64)> = None;
    // Once a file failed, the rest stays in memory.
    let mut files_fail = false;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue; // trailers: FastCGI has no place for them
        };
        if data.is_empty() {
            continue;
        }
        if file.is_none() && !files_fail && in_memory + data.len() > IN_MEMORY {
            match spill(dir, &pieces).await {
                Ok(spilled) => {
                    file = Some((spilled, in_memory as u64));
                    pieces.clear();
                    in_memory = 0;
                }
                Err(error) => {
                    say_file_trouble(dir, &error);
                    files_fail = true;
                }
            }
        }
        let write_failed = match file.as_mut() {
            Some((written, len)) => match written.write_all(&data).await {
                Ok(()) => {
                    *len += data.len() as u64;
                    continue;
                }
                Err(error) => Some(error),
            },
            None => None,
        };
        if let Some(error) = write_failed {
            // A full disk: what the file holds comes back to memory, and so does the rest.
            say_file_trouble(dir, &error);
            files_fail = true;
            if let Some((mut written, len)) = file.take() {
                let back = read_back(&mut written, len).await?;
                in_memory = back.len();
                pieces = vec![back];
            }
        }
        in_memory += data.len();
        pieces.push(data);
    }
    match file {
        Some((mut written, len)) => {
            if let Err(error) = rewind(&mut written).await {
                say_file_trouble(dir, &error);
                return Ok(Spooled::InMemory(ResendableBody::from_bytes(
                    read_back(&mut written, len).await?,
                )));
            }
            Ok(Spooled::File { file: written, len })
        }
        None => Ok(Spooled::InMemory(ResendableBody::from_pieces(pieces))),
    }
}

/// A new file under `dir` without a name (removed once open: nothing is left behind, even
/// if levee is killed), holding `pieces`.
async fn spill(dir: &Path, pieces: &[Bytes]) -> std::io::Result<tokio::fs::File> {
    static MADE: AtomicU64 = AtomicU64::new(0);
    let path = dir.join(format!(
        ".levee-body-{}-{}",
        std::process::id(),
        MADE.fetch_add(1, Ordering::Relaxed)
    ));
    let mut file = tokio::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .await?;
    tokio::fs::remove_file(&path).await?;
    for piece in pieces {
        file.write_all(piece).await?;
    }
    Ok(file)
}

async fn rewind(file: &mut tokio::fs::File) -> std::io::Result<()> {
    file.flush().await?;
    file.seek(SeekFrom::Start(0)).await?;
    Ok(())
}

/// The `len` bytes written to `file`, back in memory.
async fn read_back(file: &mut tokio::fs::File, len: u64) -> Result<Bytes, BoxError> {
    rewind(file).await?;
    let mut whole = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(len).read_to_end(&mut whole).await?;
    if (whole.len() as u64) < len {
        return Err("the request body's file was cut short".into());
    }
    Ok(Bytes::from(whole))
}

fn say_file_trouble(dir: &Path, error: &std::io::Error) {
    if let Some(held_back) = FILE_TROUBLE_LOG.allow(std::time::Instant::now()) {
        tracing::warn!(
            dir = %dir.display(),
            "a request body over 1 MiB is kept in memory while it is read: no file for it in the upstream's temp_dir: {error} ({held_back} more not logged)"
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
