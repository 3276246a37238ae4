//! Reading an operator's file with a bound on its size: the registry's
//! files and the trust bundle are re-read while the process serves, so a
//! file that grew huge (or a FIFO put in its place) must cost an error,
//! not the process's memory or its only thread.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// `O_NONBLOCK` on Linux: opening a FIFO for reading must not wait for a
/// writer (and reading one with no writer ends at once).
const O_NONBLOCK: i32 = 0o4000;

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("the file is {size} bytes, over the limit of {limit} bytes")]
    TooLarge { size: u64, limit: u64 },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Reads at most `limit` bytes of `path`, refusing a longer file. Never
/// holds more than `limit + 1` bytes, whatever the file grows to while it
/// is read.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(path)?;
    let size = file.metadata()?.len();
    if size > limit {
        return Err(ReadError::TooLarge { size, limit });
    }
    let mut bytes = Vec::with_capacity(size as usize + 1);
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge {
            size: bytes.len() as u64,
            limit,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_within_the_limit_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"hello").unwrap();
        assert_eq!(read_bounded(&path, 5).unwrap(), b"hello");
    }

    #[test]
    fn a_file_over_the_limit_is_refused_with_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"hello!").unwrap();
        let err = read_bounded(&path, 5).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the file is 6 bytes, over the limit of 5 bytes"
        );
    }

    #[test]
    fn a_fifo_without_a_writer_reads_as_empty_instead_of_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fifo");
        let status = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(read_bounded(&path, 100).unwrap(), b"");
    }
}
