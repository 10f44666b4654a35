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

/// The CUDA backend on GPUs `gpus`, or why this build has none.
#[allow(dead_code)] // Not every example offers a CUDA backend.
pub fn cuda_backend(gpus: Vec<usize>) -> Result<dsa_kv::device::BackendFactory, String> {
    #[cfg(feature = "cuda")]
    return Ok(dsa_kv::cuda::CudaDevice::factory(gpus));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = gpus;
        Err("this build has no CUDA backend: build with the `cuda` feature (on by default)".into())
    }
}
