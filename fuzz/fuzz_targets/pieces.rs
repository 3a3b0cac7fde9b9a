//! Read sizes for the targets that feed their input in pieces, as sockets deliver it.

use bytes::BytesMut;

/// Piece sizes from a seed: mostly small (1–16 bytes), now and then larger.
pub struct Pieces(u32);

impl Pieces {
    /// One byte at a time: 0 is xorshift's fixed point, so every size is 1 + 0 % 512.
    #[allow(dead_code)] // each target compiles this file; not every one feeds byte by byte
    pub fn bytewise() -> Pieces {
        Pieces(0)
    }

    pub fn new(seed: u8) -> Pieces {
        Pieces(u32::from(seed).wrapping_mul(0x9E37_79B9) | 1)
    }

    pub fn next(&mut self) -> usize {
        // xorshift32
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        let size = (self.0 >> 8) as usize;
        if size.is_multiple_of(8) {
            1 + size % 512
        } else {
            1 + size % 16
        }
    }
}

/// Appends the next read from `rest` (the input not fed yet) to `buffer`: a piece's worth, or
/// all of it without `pieces`. Returns how many bytes it fed.
pub fn feed_next(pieces: Option<&mut Pieces>, rest: &[u8], buffer: &mut BytesMut) -> usize {
    let take = match pieces {
        Some(pieces) => pieces.next().min(rest.len()),
        None => rest.len(),
    };
    buffer.extend_from_slice(&rest[..take]);
    take
}
