//! `kernel_cache_dir(path)`: where MLX keeps the kernels it compiles at run time (see
//! `Emily.KernelCache`, which checks the folder and calls this at boot).
//!
//! MLX 0.32 puts its CPU libraries in `temp_directory_path() / "mlx" / version / "cpu"`,
//! reading `TMPDIR` at every compile, and its CUDA kernels in `MLX_PTX_CACHE_DIR`, else
//! the same temp folder's `mlx/<version>/ptx`, read once. It has no other setting, so
//! the process environment's `TMPDIR` is what moves them. The BEAM's `os:putenv` does
//! not change the C environment MLX reads: it has to be set here.

use crate::error::argument_error;
use rustler::{Atom, NifResult};
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

extern "C" {
    fn geteuid() -> u32;
}

/// The folder set, for the life of the process: MLX is never pointed elsewhere later.
static DIR: Mutex<Option<String>> = Mutex::new(None);

#[rustler::nif]
fn kernel_cache_dir(path: String) -> NifResult<Atom> {
    let mut dir = DIR.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(set) = dir.as_deref() {
        return if set == path {
            Ok(crate::atoms::ok())
        } else {
            Err(argument_error(format!(
                "kernel_cache_dir: MLX's kernel cache is {set} for the life of this VM, not {path}"
            )))
        };
    }
    // Emily.KernelCache has checked the folder with its reasons; this keeps the rule
    // where the setting is made.
    let meta = std::fs::symlink_metadata(&path)
        .map_err(|e| argument_error(format!("kernel_cache_dir: {path}: {e}")))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { geteuid() };
    let private = meta.is_dir() && meta.uid() == me && meta.mode() & 0o777 == 0o700;
    if !path.starts_with('/') || !private {
        return Err(argument_error(format!(
            "kernel_cache_dir: {path} is not an absolute path to a folder of uid {me} with mode 0700"
        )));
    }
    // At boot, before any stream (and so any MLX thread) exists.
    std::env::set_var("TMPDIR", &path);
    *dir = Some(path);
    Ok(crate::atoms::ok())
}
