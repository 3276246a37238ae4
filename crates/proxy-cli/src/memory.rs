//! Resident memory of the data-path processes (`tether-proxy`, `tether
//! proxy`, `tether gateway`).
//!
//! Most of a proxy's RSS are pages of its binary (docs/performance.md,
//! "Memory"): start-up code it never runs again, and the neighbours the
//! kernel's fault-around maps beside every hot function. `tether-proxy`
//! carries only the proxy's code, which is why it ships beside `tether`
//! (whose control plane, Kubernetes client and operator tools lie between
//! the proxy's hot functions); both let go of their start-up pages here.

use std::time::Duration;

/// How long after start the start-up pages are let go: start-up (flags,
/// key and CSR, the first Certify and discovery streams) takes tens of
/// milliseconds with a reachable control plane; code it runs again later
/// (a retry, a renewal) is simply read back.
pub const RELEASE_STARTUP_PAGES_AFTER: Duration = Duration::from_secs(10);

/// Unmaps this process's clean pages of its binary and shared libraries
/// (code and read-only data), so that RSS counts what the process runs
/// from then on rather than everything it (and the dynamic loader) ran at
/// start-up. Returns the bytes of the mappings let go.
///
/// Nothing is freed or lost: the pages stay in the page cache (shared with
/// every process running the same files), and the next access to one maps it
/// back with a minor fault — what the kernel does itself to such pages
/// under memory pressure. A mapping holding any private (written) page —
/// the loader's relocated read-only data, a debugger's breakpoint — is
/// left alone: dropping those would revert them to the file's bytes.
///
/// Only the read-only segments of loaded objects are let go, located
/// through the loader (`dl_iterate_phdr`) while it holds its lock, never a
/// range merely listed in smaps: other threads run meanwhile, and a file
/// mapping smaps listed may since have been unmapped and its addresses
/// reused for live memory (the loader maps ld.so.cache only for the length
/// of a dlopen, which getaddrinfo's NSS modules do on the blocking pool;
/// a library being loaded is mapped whole with its first segment's
/// protection before its data segment goes over it). Dropping pages there
/// would zero that memory.
pub fn release_file_pages() -> std::io::Result<usize> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut release = Release {
        clean: clean_read_only_file_mappings(&smaps),
        released: 0,
    };
    // SAFETY: `release_loaded_object` is given `release`, which outlives the
    // call, and reads only what the loader hands it.
    unsafe {
        libc::dl_iterate_phdr(
            Some(release_loaded_object),
            (&mut release as *mut Release).cast(),
        );
    }
    Ok(release.released)
}

/// What [`release_file_pages`] may let go of (the mappings smaps showed
/// clean), and how much it has.
struct Release {
    clean: Vec<Mapping>,
    released: usize,
}

/// Called by `dl_iterate_phdr` for each loaded object (the binary, each
/// shared library) with the loader's lock held: no listed object is
/// unmapped (dlclose) meanwhile, and an object being loaded is listed only
/// once its segments are in place. Lets go of its read-only segments where
/// smaps showed them clean.
unsafe extern "C" fn release_loaded_object(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    data: *mut libc::c_void,
) -> libc::c_int {
    // SAFETY: `data` is the `Release` given to dl_iterate_phdr, `info` a
    // loaded object's description with its program headers.
    let (release, info) = unsafe { (&mut *data.cast::<Release>(), &*info) };
    if info.dlpi_phdr.is_null() {
        return 0;
    }
    // SAFETY: as above.
    let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum.into()) };
    let page = page_size();
    for header in headers {
        if header.p_type != libc::PT_LOAD || header.p_flags & libc::PF_W != 0 {
            continue;
        }
        let start = info.dlpi_addr as usize + header.p_vaddr as usize;
        let end = start + header.p_memsz as usize;
        // SAFETY: the pages of a read-only segment of a loaded object,
        // mapped from its file for as long as the loader's lock is held.
        release.released += unsafe {
            release_clean_within(
                &release.clean,
                start & !(page - 1),
                end.next_multiple_of(page),
            )
        };
    }
    0
}

/// Lets go of the parts of `start..end` that are in `clean` mappings;
/// returns how many bytes.
///
/// # Safety
///
/// `start..end` must be mapped from a file, read-only, and stay so for
/// the call: then a part that had no private page when smaps was read
/// has none now (nothing writes to a read-only mapping), and every page
/// let go reads back the same bytes from the file.
unsafe fn release_clean_within(clean: &[Mapping], start: usize, end: usize) -> usize {
    let mut released = 0;
    for mapping in clean {
        let (from, to) = (mapping.start.max(start), mapping.end.min(end));
        if from >= to {
            continue;
        }
        // SAFETY: by this function's contract.
        let rc =
            unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_DONTNEED) };
        if rc == 0 {
            released += to - from;
        }
    }
    released
}

fn page_size() -> usize {
    // SAFETY: no preconditions.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    }
}

#[derive(Debug, PartialEq)]
struct Mapping {
    start: usize,
    end: usize,
}

/// The private mappings of files in `smaps` that are read-only and hold
/// no private page (neither resident nor swapped out).
fn clean_read_only_file_mappings(smaps: &str) -> Vec<Mapping> {
    let mut found = Vec::new();
    // The mapping being read, while it still qualifies.
    let mut current: Option<Mapping> = None;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or("");
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                found.extend(current.take());
                let perms = fields.next().unwrap_or("");
                // address perms offset dev inode pathname
                let name = line.splitn(6, char::is_whitespace).nth(5).unwrap_or("");
                if (perms == "r-xp" || perms == "r--p") && name.trim().starts_with('/') {
                    current = Some(Mapping { start, end });
                }
                continue;
            }
        }
        if matches!(first, "Anonymous:" | "Swap:") && fields.next() != Some("0") {
            current = None;
        }
    }
    found.extend(current);
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another thread maps a file read-only, unmaps it and gets anonymous
    /// memory at the same address — what the loader does with ld.so.cache
    /// during a dlopen (glibc's NSS modules, loaded by getaddrinfo on the
    /// blocking pool), or any short-lived file mapping. A release that read
    /// smaps before the swap must not reach that memory: it would zero it.
    fn linger() {
        for _ in 0..20 {
            std::thread::yield_now();
        }
    }

    #[test]
    fn live_memory_that_replaced_a_file_mapping_is_never_let_go() {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        const LEN: usize = 64 * 4096;
        const WRITTEN: u8 = 0xaa;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("transient");
        std::fs::write(&path, vec![1u8; LEN]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let remaps = std::sync::Arc::new(AtomicU64::new(0));
        let remapper = std::thread::spawn({
            let (stop, remaps) = (stop.clone(), remaps.clone());
            move || -> Result<(), String> {
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: mappings this thread makes and unmaps itself;
                    // it reads and writes only within them.
                    unsafe {
                        let prot = libc::PROT_READ;
                        let mapped = libc::mmap(
                            std::ptr::null_mut(),
                            LEN,
                            prot,
                            libc::MAP_PRIVATE,
                            file.as_raw_fd(),
                            0,
                        );
                        assert_ne!(mapped, libc::MAP_FAILED);
                        std::ptr::read_volatile(mapped as *const u8);
                        // Both states last a while: a release reads smaps
                        // during one and lets go during the other.
                        linger();
                        libc::munmap(mapped, LEN);
                        let anon = libc::mmap(
                            std::ptr::null_mut(),
                            LEN,
                            prot | libc::PROT_WRITE,
                            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                            -1,
                            0,
                        );
                        assert_ne!(anon, libc::MAP_FAILED);
                        let bytes = anon.cast::<u8>();
                        for at in (0..LEN).step_by(4096) {
                            bytes.add(at).write_volatile(WRITTEN);
                        }
                        remaps.fetch_add(1, Ordering::Relaxed);
                        linger();
                        for at in (0..LEN).step_by(4096) {
                            let read = bytes.add(at).read_volatile();
                            if read != WRITTEN {
                                return Err(format!(
                                    "anonymous memory at {anon:?}+{at:#x} (where the file was \
                                     mapped: {}) read {read:#x}, {WRITTEN:#x} written",
                                    anon == mapped
                                ));
                            }
                        }
                        libc::munmap(anon, LEN);
                    }
                }
                Ok(())
            }
        });
        while remaps.load(Ordering::Relaxed) == 0 && !remapper.is_finished() {
            std::thread::yield_now();
        }
        for _ in 0..300 {
            release_file_pages().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        remapper.join().unwrap().unwrap();
    }

    const SMAPS: &str = "\
55d9a1c6d000-55d9a2325000 r--p 00000000 fd:00 1234   /opt/tether/bin/tether
Size:               7648 kB
Rss:                3040 kB
Anonymous:             0 kB
Swap:                  0 kB
55d9a2325000-55d9a37bb000 r-xp 006b8000 fd:00 1234   /opt/tether/bin/tether
Size:              21088 kB
Anonymous:             0 kB
Swap:                  0 kB
55d9a37bb000-55d9a387f000 r--p 01b4e000 fd:00 1234   /opt/tether/bin/tether
Size:                784 kB
Anonymous:           784 kB
Swap:                  0 kB
55d9a387f000-55d9a3884000 rw-p 01c11000 fd:00 1234   /opt/tether/bin/tether
Anonymous:            20 kB
7f0000000000-7f0000100000 r-xp 00000000 fd:00 99     /usr/lib/x86_64-linux-gnu/libc.so.6
Anonymous:             0 kB
7f0000010000-7f0000020000 r--p 00000000 00:00 0 
Anonymous:             0 kB
7ffd21c17000-7ffd21c38000 rw-p 00000000 00:00 0                          [stack]
Anonymous:           132 kB
7ffd21d00000-7ffd21d02000 r-xp 00000000 00:00 0                          [vdso]
Anonymous:             0 kB
7f0000100000-7f0000200000 r--p 00000000 fd:00 1235   /opt/tether/bin/tether-old
Anonymous:             0 kB
7f0000200000-7f0000300000 r--p 00000000 fd:00 1234   /opt/tether/bin/tether
Anonymous:             0 kB
Swap:                  4 kB
";

    #[test]
    fn only_clean_read_only_file_mappings_qualify() {
        let at = |start, end| Mapping { start, end };
        assert_eq!(
            clean_read_only_file_mappings(SMAPS),
            [
                at(0x55d9a1c6d000, 0x55d9a2325000),
                at(0x55d9a2325000, 0x55d9a37bb000),
                at(0x7f0000000000, 0x7f0000100000),
                at(0x7f0000100000, 0x7f0000200000),
            ],
            "relocated data (private pages), writable data, anonymous memory \
             and a mapping with swapped-out private pages stay"
        );
    }

    /// A private mapping of a new file of `pages` pages of `byte`, every
    /// page read (so resident). Returns its address and length.
    fn map_file(dir: &std::path::Path, pages: usize, byte: u8, prot: i32) -> (usize, usize) {
        use std::os::fd::AsRawFd;
        let len = pages * 4096;
        let path = dir.join(format!("mapped-{byte}"));
        std::fs::write(&path, vec![byte; len]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a new mapping of a file this test owns; nothing else
        // refers to the range.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        let addr = addr as usize;
        assert_eq!(read_all(addr, len), vec![byte; len]);
        (addr, len)
    }

    fn read_all(addr: usize, len: usize) -> Vec<u8> {
        // SAFETY: `addr..addr + len` is a live readable mapping made by
        // `map_file`, never unmapped.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
    }

    /// What [`release_file_pages`] does to a loaded object's segment, done
    /// to a mapping the test owns (which the loader does not list).
    fn release_range(addr: usize, len: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        // SAFETY: a read-only mapping made by `map_file`, never unmapped.
        unsafe { release_clean_within(&clean_read_only_file_mappings(&smaps), addr, addr + len) }
    }

    /// Resident KiB of the mapping that starts at `addr`.
    fn rss_kib(addr: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let header = format!("{addr:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&header));
        lines
            .find_map(|l| l.strip_prefix("Rss:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("the mapping is listed")
    }

    #[test]
    fn clean_file_pages_leave_rss_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let (addr, len) = map_file(dir.path(), 64, 0xab, libc::PROT_READ);
        let released = release_range(addr, len);
        assert!(released >= len, "{released} bytes let go");
        // Nothing touches the mapping in between (another test's release
        // can only let go of more).
        assert_eq!(rss_kib(addr), 0, "the clean mapping is no longer resident");
        assert_eq!(read_all(addr, len), vec![0xab; len], "same bytes read back");
        assert!(rss_kib(addr) > 0, "and resident again");
    }

    #[test]
    fn a_mapping_with_a_written_page_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let (addr, len) = map_file(dir.path(), 4, 0x11, libc::PROT_READ | libc::PROT_WRITE);
        // A private copy of one page, then read-only: like the loader's
        // relocated data.
        // SAFETY: the first page of the writable mapping made above.
        unsafe { *(addr as *mut u8) = 0x22 };
        // SAFETY: the whole mapping made above.
        let rc = unsafe { libc::mprotect(addr as *mut libc::c_void, len, libc::PROT_READ) };
        assert_eq!(rc, 0);
        release_range(addr, len);
        let bytes = read_all(addr, len);
        assert_eq!(bytes[0], 0x22, "the written byte is kept, not reverted");
        assert!(bytes[1..].iter().all(|b| *b == 0x11));
    }

    #[test]
    fn the_process_runs_on_after_letting_go_of_its_own_code() {
        let released = release_file_pages().unwrap();
        assert!(
            released > 0,
            "the test binary's code is a clean file mapping"
        );
        // Run code let go of just now: the formatting machinery.
        assert_eq!(format!("{released:#x}"), format!("0x{released:x}"));
    }
}
