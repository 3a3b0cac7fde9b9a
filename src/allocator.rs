//! The binary's global allocator: mimalloc, called the way its own `malloc` is fastest.
//!
//! A request makes about twenty allocations, and mimalloc serves small ones in a fraction of
//! glibc malloc's instructions. Asked for an alignment, though, its `mi_malloc_aligned` takes
//! a slow path for every block over 1 KiB that is not a power of two up to 4 KiB: it
//! over-allocates by the alignment and marks the page as holding interior pointers, which
//! also slows every later free there. Most of levee's larger blocks are like that (a boxed
//! request future, a response head with its body), and callgrind counted about 120
//! instructions per such allocation. Plain `mi_malloc` already aligns every block of 16 bytes
//! or more to 16 (mimalloc rounds its size classes to two machine words), so only stricter
//! alignments go to the aligned calls.

// The one place levee needs `unsafe`: a global allocator is an unsafe trait by definition.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys::{
    mi_free, mi_malloc, mi_malloc_aligned, mi_realloc, mi_realloc_aligned, mi_zalloc,
    mi_zalloc_aligned,
};

/// The alignment every `mi_malloc` block of at least this many bytes has (`MI_MAX_ALIGN_SIZE`).
const PLAIN_ALIGNMENT: usize = 16;

/// Whether a block of `size` bytes aligned to `align` is what plain `mi_malloc` returns anyway.
/// (A block under 16 bytes may be only 8-aligned, as with the system allocator.)
fn plain(size: usize, align: usize) -> bool {
    align <= PLAIN_ALIGNMENT && align <= size
}

pub struct Mimalloc;

// SAFETY: every pointer comes from mimalloc, with at least the layout's alignment (`plain`
// sends only what `mi_malloc` already aligns to it), and goes back to it through `mi_free` or
// a realloc, which accept any mimalloc pointer, aligned or not.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: plain FFI calls; mimalloc returns null when out of memory, as the trait asks.
        unsafe {
            if plain(layout.size(), layout.align()) {
                mi_malloc(layout.size()).cast()
            } else {
                mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        unsafe {
            if plain(layout.size(), layout.align()) {
                mi_zalloc(layout.size()).cast()
            } else {
                mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: the caller passes a pointer this allocator returned.
        unsafe { mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller passes a pointer this allocator returned, and a non-zero size.
        unsafe {
            if plain(new_size, layout.align()) {
                mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_have_their_alignment_and_keep_their_bytes_when_grown() {
        let allocator = Mimalloc;
        for align in [1, 2, 8, 16, 32, 64, 128, 4096] {
            for size in [1, 7, 8, 16, 24, 1000, 1500, 5000, 70_000] {
                let Ok(layout) = Layout::from_size_align(size, align) else {
                    continue;
                };
                // SAFETY: a non-zero layout; the block is freed with the same allocator.
                unsafe {
                    let block = allocator.alloc(layout);
                    assert!(!block.is_null());
                    assert_eq!(block as usize % align, 0, "size {size} align {align}");
                    block.write_bytes(0xA5, size);
                    let grown = allocator.realloc(block, layout, size * 3);
                    assert_eq!(grown as usize % align, 0, "grown {size} align {align}");
                    assert!((0..size).all(|index| *grown.add(index) == 0xA5));
                    allocator.dealloc(grown, Layout::from_size_align_unchecked(size * 3, align));
                    let zeroed = allocator.alloc_zeroed(layout);
                    assert_eq!(zeroed as usize % align, 0);
                    assert!((0..size).all(|index| *zeroed.add(index) == 0));
                    allocator.dealloc(zeroed, layout);
                }
            }
        }
    }
}
