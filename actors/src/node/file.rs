//! The ledger file's operating-system pieces: opening it privately, its byte locks
//! (open-file-description locks, released by the kernel with their descriptors) and the
//! shared page waiting workers sleep on.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A shared mapping of a ledger's first page.
#[derive(Debug)]
pub(super) struct Mapping(*mut libc::c_void);

// SAFETY: the mapping is only read and written through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

const PAGE: usize = 4096;

impl Mapping {
    pub(super) fn new(f: &File) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd;
        if f.metadata()?.len() < PAGE as u64 {
            f.set_len(PAGE as u64)?;
        }
        // SAFETY: a shared read-write mapping of a page of an open file; unmapped on drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(p))
    }

    pub(super) fn releases(&self) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: the page is mapped for the mapping's life and 4-aligned; only atomics
        // touch the word.
        unsafe { &*(self.0 as *const std::sync::atomic::AtomicU32) }
    }

    /// Sleeps until the release count moves from `seen` (or `max` passes).
    pub(super) fn wait(&self, seen: u32, max: Duration) {
        let ts = libc::timespec {
            tv_sec: max.as_secs() as libc::time_t,
            tv_nsec: max.subsec_nanos() as libc::c_long,
        };
        // SAFETY: a futex wait on a mapped word, with a valid timeout.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.releases().as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Counts a release and wakes one waiting worker, of any process.
    pub(super) fn released(&self, someone_waits: bool) {
        self.releases().fetch_add(1, Ordering::Release);
        if someone_waits {
            // SAFETY: a futex wake on a mapped word.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    self.releases().as_ptr(),
                    libc::FUTEX_WAKE,
                    1u32,
                    std::ptr::null::<libc::timespec>(),
                    std::ptr::null::<u32>(),
                    0u32,
                );
            }
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe {
            libc::munmap(self.0, PAGE);
        }
    }
}

/// Opens the ledger file (created readable and writable by its user only: anyone who can
/// read it can lock its bytes, so another user could hold a budget's cores).
pub(super) fn open_ledger(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    Ok(f)
}

/// Refuses a ledger file another user owns or others may read (they could lock its cores).
pub(super) fn check_owner(f: &File, path: &Path, uid: u32) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata()?;
    if m.uid() != uid || m.mode() & 0o077 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is owned by uid {} with mode {:o}: a node CPU budget's ledger must be this \
                 user's (uid {uid}) and private to it; remove it or set FLOWGATE_NODE_KEY",
                path.display(),
                m.uid(),
                m.mode() & 0o777
            ),
        ));
    }
    Ok(())
}

fn flock_at(byte: u64, kind: i16) -> libc::flock {
    // SAFETY: `flock` is plain old data; zero is a valid value of every field.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fl
}

/// Takes (or releases, with `F_UNLCK`) the lock on `byte` without waiting; `Ok(false)` when
/// another descriptor holds a conflicting one.
pub(super) fn setlk(f: &File, byte: u64, kind: i16) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let fl = flock_at(byte, kind);
    // SAFETY: a valid descriptor and a valid `flock` for the call's duration.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

/// Whether another descriptor holds a lock on `byte` that an exclusive lock would conflict
/// with.
pub(super) fn getlk(f: &File, byte: u64) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut fl = flock_at(byte, libc::F_WRLCK as i16);
    // SAFETY: a valid descriptor and a valid, writable `flock` for the call's duration.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as i16)
}
