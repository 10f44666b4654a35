//! What the example binaries share.

/// A closed stdout (`... --json | head`) ends the program quietly, as it does any Unix
/// tool, instead of a panic in `println!`. Call first in `main`.
pub fn quiet_on_closed_stdout() {
    // SAFETY: called first in `main`, before any other thread exists; SIG_DFL is a valid
    // disposition for SIGPIPE.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
