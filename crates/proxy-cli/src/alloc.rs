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

#[cfg(test)]
mod stress {
    //! Many threads allocating, growing, shrinking and freeing blocks of
    //! random sizes, alignments and kinds, handing live blocks to each
    //! other and ending while others still hold their blocks: every byte a
    //! block was given must still be there, so a block handed out twice, a
    //! class block that is too small or a block freed early shows.

    use super::*;
    use std::sync::mpsc;

    /// xorshift64*: a fixed seed per thread, so a failure repeats.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        /// Mostly sizes around and inside the classes, their edges often.
        fn size(&mut self) -> usize {
            match self.below(8) {
                0 => 1 + self.below(1100),
                1 => {
                    let edge = CLASSES[self.below(CLASSES.len())];
                    edge - 1 + self.below(3)
                }
                2 => 16_000 + self.below(4000),
                _ => 1000 + self.below(15_500),
            }
        }

        fn align(&mut self) -> usize {
            [1, 8, 16, 16, 32, 64][self.below(6)]
        }
    }

    /// A live block and the pattern written into it.
    struct Block {
        ptr: usize,
        layout: Layout,
        seed: u8,
    }

    impl Block {
        fn fill(&self) {
            let ptr = self.ptr as *mut u8;
            for i in 0..self.layout.size() {
                // SAFETY: the block holds layout.size() bytes, owned here.
                unsafe { ptr.add(i).write(self.seed.wrapping_add(i as u8)) };
            }
        }

        /// Whether the first `len` bytes still hold the pattern.
        fn holds(&self, len: usize) -> bool {
            let ptr = self.ptr as *const u8;
            // SAFETY: as fill, for len <= layout.size().
            (0..len).all(|i| unsafe { ptr.add(i).read() } == self.seed.wrapping_add(i as u8))
        }
    }

    fn allocate(rng: &mut Rng, seed: u8) -> Block {
        let layout = Layout::from_size_align(rng.size(), rng.align()).unwrap();
        let zeroed = rng.below(4) == 0;
        // SAFETY: a non-zero size.
        let ptr = unsafe {
            if zeroed {
                BlockCache.alloc_zeroed(layout)
            } else {
                BlockCache.alloc(layout)
            }
        };
        assert!(!ptr.is_null());
        assert_eq!(ptr as usize % layout.align(), 0, "{layout:?}");
        if zeroed {
            // SAFETY: the block holds layout.size() bytes.
            assert!((0..layout.size()).all(|i| unsafe { ptr.add(i).read() } == 0));
        }
        let block = Block {
            ptr: ptr as usize,
            layout,
            seed,
        };
        block.fill();
        block
    }

    fn free(block: Block) {
        assert!(block.holds(block.layout.size()), "{:?}", block.layout);
        // SAFETY: allocated by BlockCache at this layout.
        unsafe { BlockCache.dealloc(block.ptr as *mut u8, block.layout) };
    }

    /// Grows or shrinks a block, several times in a row at random sizes.
    fn realloc_chain(rng: &mut Rng, mut block: Block) -> Block {
        for _ in 0..1 + rng.below(4) {
            let new_size = rng.size();
            // SAFETY: allocated by BlockCache at this layout; a non-zero size.
            let ptr = unsafe { BlockCache.realloc(block.ptr as *mut u8, block.layout, new_size) };
            assert!(!ptr.is_null());
            assert_eq!(ptr as usize % block.layout.align(), 0);
            let kept = block.layout.size().min(new_size);
            block.ptr = ptr as usize;
            assert!(block.holds(kept), "{:?} -> {new_size}", block.layout);
            block.layout = Layout::from_size_align(new_size, block.layout.align()).unwrap();
            block.fill();
        }
        block
    }

    /// One thread's work: keeps up to 64 blocks live, gives some to the
    /// next thread, frees what the previous one gave it; returns the blocks
    /// still live when it ends, for a thread of the next round to free.
    fn churn(
        seed: u64,
        steps: usize,
        given: mpsc::Receiver<Block>,
        give: mpsc::Sender<Block>,
        inherited: Vec<Block>,
    ) -> Vec<Block> {
        let mut rng = Rng(seed | 1);
        let mut live = inherited;
        for step in 0..steps {
            for block in given.try_iter() {
                free(block);
            }
            match rng.below(10) {
                0..=3 if live.len() < 64 => live.push(allocate(&mut rng, step as u8)),
                4..=5 if !live.is_empty() => {
                    let block = live.swap_remove(rng.below(live.len()));
                    live.push(realloc_chain(&mut rng, block));
                }
                6 if !live.is_empty() => {
                    // The receiver may have ended: then the block comes back.
                    if let Err(mpsc::SendError(block)) =
                        give.send(live.swap_remove(rng.below(live.len())))
                    {
                        free(block);
                    }
                }
                _ if !live.is_empty() => free(live.swap_remove(rng.below(live.len()))),
                _ => {}
            }
        }
        live.extend(given.try_iter());
        live
    }

    #[test]
    fn threads_that_come_and_go_never_share_or_lose_a_byte() {
        const THREADS: usize = 4;
        let mut inherited: Vec<Vec<Block>> = (0..THREADS).map(|_| Vec::new()).collect();
        for round in 0..4u64 {
            let (senders, receivers): (Vec<_>, Vec<_>) =
                (0..THREADS).map(|_| mpsc::channel()).unzip();
            let mut receivers: Vec<Option<_>> = receivers.into_iter().map(Some).collect();
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let given = receivers[t].take().unwrap();
                    let give = senders[(t + 1) % THREADS].clone();
                    let blocks = std::mem::take(&mut inherited[(t + 1) % THREADS]);
                    let seed = round * 1000 + t as u64;
                    std::thread::spawn(move || churn(seed, 500, given, give, blocks))
                })
                .collect();
            drop(senders);
            for (t, handle) in handles.into_iter().enumerate() {
                inherited[t] = handle.join().unwrap();
            }
        }
        for block in inherited.into_iter().flatten() {
            free(block);
        }
    }
}

#[cfg(test)]
mod thread_end {
    //! Blocks allocated and freed by other thread-locals' destructors,
    //! before and after the cache's own has run.

    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const LAYOUT: Layout = valid_layout(2000);

    const fn valid_layout(size: usize) -> Layout {
        match Layout::from_size_align(size, 8) {
            Ok(layout) => layout,
            Err(_) => panic!("a valid layout"),
        }
    }

    /// Set by the destructors below (a panic there would abort the tests).
    static AFTER_CACHE: AtomicUsize = AtomicUsize::new(0);
    static FIRST_USE_IN_DESTRUCTOR: AtomicUsize = AtomicUsize::new(0);

    /// Allocates, fills, checks and frees a few class blocks; true when
    /// every byte was as written.
    fn round_trip() -> bool {
        let mut ok = true;
        // SAFETY: a non-zero size; each block freed at the layout it got.
        unsafe {
            let blocks: Vec<*mut u8> = (0..8).map(|_| BlockCache.alloc(LAYOUT)).collect();
            for (n, &b) in blocks.iter().enumerate() {
                ok &= !b.is_null();
                b.write_bytes(n as u8, LAYOUT.size());
            }
            for (n, &b) in blocks.iter().enumerate() {
                ok &= (0..LAYOUT.size()).all(|i| b.add(i).read() == n as u8);
                BlockCache.dealloc(b, LAYOUT);
            }
        }
        ok
    }

    /// Holds a class block taken while the cache was alive, and frees it
    /// from its destructor.
    struct Holder(Cell<*mut u8>);

    impl Drop for Holder {
        fn drop(&mut self) {
            let cache_gone = CACHE.try_with(|_| ()).is_err();
            let block = self.0.get();
            // SAFETY: allocated below at LAYOUT, freed once here.
            let kept = unsafe {
                let kept = (0..LAYOUT.size()).all(|i| block.add(i).read() == 0xa5);
                BlockCache.dealloc(block, LAYOUT);
                kept
            };
            if cache_gone && kept && round_trip() {
                AFTER_CACHE.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Uses the cache for the first time on its thread from a destructor.
    struct FirstUse;

    impl Drop for FirstUse {
        fn drop(&mut self) {
            let cache_alive = CACHE.try_with(|_| ()).is_ok();
            if cache_alive && round_trip() && round_trip() {
                FIRST_USE_IN_DESTRUCTOR.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    thread_local! {
        static HOLDER: Holder = const { Holder(Cell::new(ptr::null_mut())) };
        static FIRST_USE: FirstUse = const { FirstUse };
    }

    #[test]
    fn destructors_after_the_caches_free_and_allocate_through_malloc() {
        std::thread::spawn(|| {
            // Registered before the cache's destructor, so run after it.
            HOLDER.with(|h| {
                // SAFETY: a non-zero size; freed by Holder's destructor.
                let block = unsafe { BlockCache.alloc(LAYOUT) };
                // SAFETY: the block holds LAYOUT.size() bytes.
                unsafe { block.write_bytes(0xa5, LAYOUT.size()) };
                h.0.set(block);
            });
            assert!(round_trip());
            let class = class_of(&LAYOUT).unwrap();
            assert!(CACHE.with(|c| c.counts[class].get()) > 0, "blocks kept");
        })
        .join()
        .unwrap();
        assert_eq!(AFTER_CACHE.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_destructor_may_be_the_first_to_use_the_cache() {
        std::thread::spawn(|| FIRST_USE.with(|_| ()))
            .join()
            .unwrap();
        assert_eq!(FIRST_USE_IN_DESTRUCTOR.load(Ordering::SeqCst), 1);
    }
}
