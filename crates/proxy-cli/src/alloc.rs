//! A per-thread cache of freed heap blocks of 1-16 KiB in front of glibc's
//! malloc, the proxy's global allocator.
//!
//! Why: a proxied request allocates a few blocks of that size and frees
//! them when it ends: the boxed steps of a request (1.3-3 KiB), hyper's
//! 8 KiB read buffer, an h2 stream's state. glibc's per-thread cache
//! (tcache) stops at 1,032 bytes and cannot be raised past it in glibc
//! 2.36, so each of those takes malloc's slow path: bins searched,
//! neighbours coalesced on free, the fast bins consolidated before every
//! large request; ~440 instructions an allocation and its free, counted
//! with `proxy-latency --callgrind` (docs/performance.md, eighth pass).
//! A block freed here is kept, up to a small count per size class, and
//! handed to the next allocation of its class: a few instructions.
//!
//! Allocators that replace malloc whole (mimalloc, jemalloc) were measured
//! and not kept: no less CPU, and twice the resident memory.
//!
//! Bounds: each class keeps at most [`CLASS_BYTES`] of blocks per thread
//! (a little under 512 KiB per thread in all); a thread's blocks go back to
//! malloc when it ends. Blocks are taken from and given back to malloc at
//! their class's size, so any block of a class fits any request of it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ptr;

/// Block sizes kept, smallest first: a request is served from the first
/// class at least its size.
const CLASSES: [usize; 8] = [1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384];
/// Requests up to this take glibc's own per-thread cache.
const SMALLEST: usize = 1024;
/// What one class keeps per thread at most, in bytes.
const CLASS_BYTES: usize = 64 * 1024;
/// Blocks come from malloc, which aligns to 16; more alignment is left to
/// `System`.
const ALIGN: usize = 16;

/// The proxy's global allocator (`#[global_allocator]` in each binary).
pub struct BlockCache;

/// The class of a layout this cache serves, if any.
fn class_of(layout: &Layout) -> Option<usize> {
    let size = layout.size();
    if size <= SMALLEST || size > CLASSES[CLASSES.len() - 1] || layout.align() > ALIGN {
        return None;
    }
    CLASSES.iter().position(|&c| c >= size)
}

fn class_layout(class: usize) -> Layout {
    // SAFETY: every class size is non-zero and a multiple of ALIGN, a
    // power of two; neither overflows isize.
    unsafe { Layout::from_size_align_unchecked(CLASSES[class], ALIGN) }
}

/// One thread's free blocks: a singly linked list per class, the link in
/// each free block's first word.
struct Cache {
    heads: [Cell<*mut u8>; CLASSES.len()],
    counts: [Cell<usize>; CLASSES.len()],
}

impl Cache {
    const fn new() -> Self {
        Self {
            heads: [const { Cell::new(ptr::null_mut()) }; CLASSES.len()],
            counts: [const { Cell::new(0) }; CLASSES.len()],
        }
    }

    fn pop(&self, class: usize) -> Option<*mut u8> {
        let head = self.heads[class].get();
        if head.is_null() {
            return None;
        }
        // SAFETY: a cached block is one of this class's blocks, at least
        // a word long and aligned to 16, whose first word push wrote.
        let next = unsafe { head.cast::<*mut u8>().read() };
        self.heads[class].set(next);
        self.counts[class].set(self.counts[class].get() - 1);
        Some(head)
    }

    /// Keeps `block` unless its class is full; false when not kept.
    fn push(&self, class: usize, block: *mut u8) -> bool {
        let count = self.counts[class].get();
        if (count + 1) * CLASSES[class] > CLASS_BYTES {
            return false;
        }
        // SAFETY: the block was allocated at this class's size and freed by
        // its owner: nobody else reads or writes it until pop hands it out.
        unsafe { block.cast::<*mut u8>().write(self.heads[class].get()) };
        self.heads[class].set(block);
        self.counts[class].set(count + 1);
        true
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        for class in 0..CLASSES.len() {
            while let Some(block) = self.pop(class) {
                // SAFETY: taken from malloc at this class's layout.
                unsafe { System.dealloc(block, class_layout(class)) };
            }
        }
    }
}

thread_local! {
    // Const-initialised: no allocation on first use, and `try_with`
    // fails (and the block goes to malloc) while the thread ends.
    static CACHE: Cache = const { Cache::new() };
}

// SAFETY: every block handed out is either System's for the layout asked
// (outside the classes) or a block System allocated at the class's size,
// which is at least the size asked and aligned to 16 (classes serve only
// alignments up to 16); a block is in one place at a time (a thread's
// list, or its owner).
unsafe impl GlobalAlloc for BlockCache {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(class) = class_of(&layout) else {
            // SAFETY: the caller's layout, as the caller gave it.
            return unsafe { System.alloc(layout) };
        };
        match CACHE.try_with(|c| c.pop(class)) {
            Ok(Some(block)) => block,
            // SAFETY: a class's layout is valid and non-zero.
            _ => unsafe { System.alloc(class_layout(class)) },
        }
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        let Some(class) = class_of(&layout) else {
            // SAFETY: allocated by System at this layout (alloc above).
            return unsafe { System.dealloc(block, layout) };
        };
        if !CACHE.try_with(|c| c.push(class, block)).unwrap_or(false) {
            // SAFETY: a block of a class comes from System at the class's
            // layout, from alloc or from a cache that got it from there.
            unsafe { System.dealloc(block, class_layout(class)) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if class_of(&layout).is_none() {
            // SAFETY: the caller's layout, as the caller gave it.
            return unsafe { System.alloc_zeroed(layout) };
        }
        // SAFETY: as alloc; the block holds at least layout.size() bytes.
        unsafe {
            let block = self.alloc(layout);
            if !block.is_null() {
                block.write_bytes(0, layout.size());
            }
            block
        }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees new_size, rounded up to the
        // alignment, does not overflow isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (class_of(&layout), class_of(&new_layout)) {
            // SAFETY: a block System allocated at `layout` (no class).
            (None, None) => unsafe { System.realloc(block, layout, new_size) },
            // The block is already of the class's size.
            (Some(old), Some(new)) if old == new => block,
            // Into or out of a class, or across classes: a block of the
            // new size's own kind, so that its free finds it as allocated.
            // SAFETY: both blocks hold at least the bytes copied; the old
            // one is freed at the layout it was allocated with.
            _ => unsafe {
                let moved = self.alloc(new_layout);
                if !moved.is_null() {
                    ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                    self.dealloc(block, layout);
                }
                moved
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sizes_above_glibcs_cache_and_up_to_16_kib_have_a_class() {
        let class = |size, align| class_of(&Layout::from_size_align(size, align).unwrap());
        assert_eq!(class(1024, 8), None);
        assert_eq!(class(1025, 8), Some(0));
        assert_eq!(class(1536, 16), Some(0));
        assert_eq!(class(1537, 8), Some(1));
        assert_eq!(class(8192, 8), Some(5));
        assert_eq!(class(16384, 8), Some(7));
        assert_eq!(class(16385, 8), None);
        assert_eq!(class(4096, 64), None, "over-aligned blocks are System's");
        for (i, size) in CLASSES.iter().enumerate() {
            assert_eq!(class(*size, 1), Some(i));
            assert_eq!(size % ALIGN, 0);
        }
    }

    #[test]
    fn a_freed_block_is_handed_out_again_and_a_full_class_keeps_no_more() {
        let cache = Cache::new();
        let layout = class_layout(3);
        let limit = CLASS_BYTES / CLASSES[3];
        let blocks: Vec<*mut u8> = (0..limit + 3)
            // SAFETY: test blocks, allocated and freed at the layouts used here.
            .map(|_| unsafe { System.alloc(layout) })
            .collect();
        let mut given_back = Vec::new();
        for &b in &blocks {
            if !cache.push(3, b) {
                given_back.push(b);
            }
        }
        assert_eq!(given_back.len(), 3, "a class keeps {limit} blocks");
        assert_eq!(cache.counts[3].get(), limit);
        // Last in, first out: the warmest block first.
        let warm = cache.pop(3);
        assert_eq!(warm, Some(blocks[limit - 1]));
        assert_eq!(cache.pop(2), None);
        given_back.extend(warm);
        for b in given_back {
            // SAFETY: test blocks, allocated and freed at the layouts used here.
            unsafe { System.dealloc(b, layout) };
        }
        drop(cache);
    }

    #[test]
    fn contents_survive_a_realloc_into_out_of_and_across_classes() {
        let a = BlockCache;
        // SAFETY: test blocks, allocated and freed at the layouts used here.
        unsafe {
            let mut size = 100;
            let mut block = a.alloc(Layout::from_size_align(size, 8).unwrap());
            for i in 0..size {
                block.add(i).write(i as u8);
            }
            // 100 → 1,500 (into), → 1,530 (same class), → 5,000 (across),
            // → 20,000 (out), → 3,000 (back in).
            for new_size in [1500, 1530, 5000, 20_000, 3000] {
                block = a.realloc(block, Layout::from_size_align(size, 8).unwrap(), new_size);
                assert!(!block.is_null());
                for i in 0..100 {
                    assert_eq!(block.add(i).read(), i as u8, "byte {i} after {new_size}");
                }
                size = new_size;
            }
            a.dealloc(block, Layout::from_size_align(size, 8).unwrap());
            let zeroed = a.alloc_zeroed(Layout::from_size_align(3000, 8).unwrap());
            assert!((0..3000).all(|i| zeroed.add(i).read() == 0));
            a.dealloc(zeroed, Layout::from_size_align(3000, 8).unwrap());
        }
    }

    #[test]
    fn threads_allocate_and_free_each_others_blocks() {
        // A block freed on another thread joins that thread's cache; each
        // thread's cache goes back to malloc when the thread ends.
        let a = &BlockCache;
        let layout = Layout::from_size_align(2000, 8).unwrap();
        let blocks: Vec<usize> = (0..64)
            // SAFETY: test blocks, allocated and freed at the layouts used here.
            .map(|_| unsafe { a.alloc(layout) } as usize)
            .collect();
        std::thread::scope(|s| {
            for chunk in blocks.chunks(16) {
                s.spawn(move || {
                    for &b in chunk {
                        // SAFETY: test blocks, allocated and freed at the layouts used here.
                        unsafe { a.dealloc(b as *mut u8, layout) };
                    }
                    let again: Vec<usize> = (0..16)
                        // SAFETY: test blocks, allocated and freed at the layouts used here.
                        .map(|_| unsafe { a.alloc(layout) } as usize)
                        .collect();
                    for b in again {
                        // SAFETY: test blocks, allocated and freed at the layouts used here.
                        unsafe { a.dealloc(b as *mut u8, layout) };
                    }
                });
            }
        });
    }
}
