//! Resident memory of the data-path processes (`tether proxy`, `tether
//! gateway`).
//!
//! Four fifths of a proxy's RSS are pages of the `tether` binary itself
//! (docs/performance.md, "Memory"): the one binary carries the control
//! plane, the Kubernetes client and the operator tools, and a proxy maps
//! half of its 21 MiB of code — start-up code it never runs again, and the
//! neighbours the kernel's fault-around maps beside every hot function —
//! while it runs 2-2.5 MiB of it under load.

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
pub fn release_file_pages() -> std::io::Result<usize> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut released = 0;
    for mapping in clean_read_only_file_mappings(&smaps) {
        // SAFETY: the range is one whole private mapping of a file,
        // read-only, with no private page (checked from smaps just above;
        // nothing in the process writes to a read-only mapping): after
        // MADV_DONTNEED every page reads back the same bytes from the file.
        let rc = unsafe {
            libc::madvise(
                mapping.start as *mut libc::c_void,
                mapping.end - mapping.start,
                libc::MADV_DONTNEED,
            )
        };
        if rc == 0 {
            released += mapping.end - mapping.start;
        }
    }
    Ok(released)
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
        let released = release_file_pages().unwrap();
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
        release_file_pages().unwrap();
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
