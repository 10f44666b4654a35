//! What the example binaries share: SIGPIPE, the CUDA backend switch, and the pieces of
//! their command lines (parsed by `clap`) that more than one example takes.

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{CommandFactory, ValueEnum};

/// A closed stdout (`... --json | head`) ends the program quietly, as it does any Unix
/// tool, instead of a panic in `println!`. Call first in `main`.
pub(crate) fn quiet_on_closed_stdout() {
    // SAFETY: called first in `main`, before any other thread exists; SIG_DFL is a valid
    // disposition for SIGPIPE.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// The CUDA backend on GPUs `gpus`, or why this build has none.
#[allow(dead_code)] // Not every example offers a CUDA backend.
pub(crate) fn cuda_backend(gpus: Vec<usize>) -> Result<dsa_kv::device::BackendFactory, String> {
    #[cfg(feature = "cuda")]
    return Ok(dsa_kv::cuda::CudaDevice::factory(gpus));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = gpus;
        Err("this build has no CUDA backend: build with the `cuda` feature (on by default)".into())
    }
}

/// Where the device actors run (`--backend`).
#[allow(dead_code)] // Not every example offers a CUDA backend.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub(crate) enum Backend {
    /// Host memory and the host reference ops (no GPU needed).
    Host,
    /// NVIDIA GPUs: pools in GPU memory, the crate's CUDA kernels.
    Cuda,
}

/// A value parser for one of the crate's named enums (`KvDtype`, `ModelPreset`, …, each
/// with `ALL` and `name`): `--help` lists the names, and any other word is clap's error.
#[allow(dead_code)] // Not every example takes such a value.
pub(crate) fn named<T>(all: &[T], name: fn(T) -> &'static str) -> impl TypedValueParser<Value = T>
where
    T: Copy + Send + Sync + 'static,
{
    let all = all.to_vec();
    PossibleValuesParser::new(all.iter().map(|&t| name(t)).collect::<Vec<_>>()).map(move |given| {
        *all.iter()
            .find(|&&t| name(t) == given)
            .expect("invariant: clap passes on only the names it was given")
    })
}

/// GPU ordinals as `--gpus` takes them: `0,1` (spaces around the commas allowed).
#[allow(dead_code)] // Not every example takes GPU ordinals.
pub(crate) fn gpu_ordinals(list: &str) -> Result<Vec<usize>, String> {
    list.split(',')
        .map(|x| x.trim().parse())
        .collect::<Result<_, _>>()
        .map_err(|_| "takes comma-separated GPU ordinals like 0,1".to_string())
}

/// Ends the program as clap ends it on a bad command line (the message, the usage,
/// exit status 2), for the checks between flags that clap cannot express.
#[allow(dead_code)] // Not every example has such checks.
pub(crate) fn usage_error<A: CommandFactory>(message: impl std::fmt::Display) -> ! {
    A::command()
        .error(clap::error::ErrorKind::ArgumentConflict, message)
        .exit()
}
