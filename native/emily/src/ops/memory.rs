//! Memory controls: MLX's allocator statistics and limits (`optable/memory.ops`).
//!
//! The allocator is global, but every call still runs on a worker thread (Elixir passes
//! the default CPU stream), never on a scheduler: `clear_cache` and `set_cache_limit`
//! synchronize every CPU stream, and the set of threads that call MLX stays fixed.

use crate::bridge::ffi;
use crate::error::Error;
use crate::stream::StreamArg;
use crate::tensor::Reply;
use crate::worker::State;
use rustler::{Encoder, Env, NifMap, NifResult, Term};
use std::sync::atomic::{AtomicU64, Ordering};

/// MLX has no getter for the cache limit: Emily remembers the last one it set, and asks
/// MLX once (setting it back at once) before that.
static CACHE_LIMIT: AtomicU64 = AtomicU64::new(u64::MAX);

#[derive(NifMap)]
struct Stats {
    active: u64,
    peak: u64,
    cache: u64,
    memory_limit: u64,
    cache_limit: u64,
}

fn mlx(op: &str, e: cxx::Exception) -> Error {
    Error::Mlx { op: op.into(), message: e.what().into(), inputs: "none".into() }
}

fn cache_limit() -> Result<u64, Error> {
    let known = CACHE_LIMIT.load(Ordering::Acquire);
    if known != u64::MAX {
        return Ok(known);
    }
    let current = ffi::memory_set_cache_limit(0).map_err(|e| mlx("memory_stats", e))?;
    ffi::memory_set_cache_limit(current).map_err(|e| mlx("memory_stats", e))?;
    // A concurrent set_cache_limit wins over the probe.
    let _ = CACHE_LIMIT.compare_exchange(u64::MAX, current, Ordering::AcqRel, Ordering::Acquire);
    Ok(CACHE_LIMIT.load(Ordering::Acquire))
}

/// Runs `f` on `stream`'s worker and replies its result to the caller.
fn on_worker<'a, T, F>(
    env: Env<'a>,
    reference: Term<'a>,
    stream: &StreamArg,
    op: &str,
    f: F,
) -> NifResult<Term<'a>>
where
    T: Encoder + 'static,
    F: FnOnce() -> Result<T, Error> + Send + 'static,
{
    let worker = stream.worker(op)?;
    let reply = Reply::new(env, reference);
    worker.submit(Box::new(move |_: &mut State| reply.send_result(f())));
    Ok(reference)
}

fn limit_arg(op: &str, limit: i64) -> NifResult<u64> {
    u64::try_from(limit).map_err(|_| {
        crate::error::argument_error(format!("{op}: a limit is a non-negative number of bytes, got {limit}"))
    })
}

/// `memory_stats(ref, stream)`: replies `%{active:, peak:, cache:, memory_limit:,
/// cache_limit:}`, in bytes.
#[rustler::nif]
fn memory_stats<'a>(env: Env<'a>, reference: Term<'a>, stream: StreamArg) -> NifResult<Term<'a>> {
    on_worker(env, reference, &stream, "memory_stats", || {
        let op = "memory_stats";
        Ok(Stats {
            active: ffi::memory_active().map_err(|e| mlx(op, e))?,
            peak: ffi::memory_peak().map_err(|e| mlx(op, e))?,
            cache: ffi::memory_cache().map_err(|e| mlx(op, e))?,
            memory_limit: ffi::memory_limit().map_err(|e| mlx(op, e))?,
            cache_limit: cache_limit()?,
        })
    })
}

/// `reset_peak_memory(ref, stream)`: replies `:ok`.
#[rustler::nif]
fn reset_peak_memory<'a>(env: Env<'a>, reference: Term<'a>, stream: StreamArg) -> NifResult<Term<'a>> {
    on_worker(env, reference, &stream, "reset_peak_memory", || {
        ffi::memory_reset_peak().map_err(|e| mlx("reset_peak_memory", e))?;
        Ok(crate::atoms::ok())
    })
}

/// `clear_cache(ref, stream)`: returns MLX's cached buffers to the system; replies `:ok`.
#[rustler::nif]
fn clear_cache<'a>(env: Env<'a>, reference: Term<'a>, stream: StreamArg) -> NifResult<Term<'a>> {
    on_worker(env, reference, &stream, "clear_cache", || {
        ffi::memory_clear_cache().map_err(|e| mlx("clear_cache", e))?;
        Ok(crate::atoms::ok())
    })
}

/// `set_memory_limit(ref, stream, bytes)`: replies the previous limit. `bytes` > 0.
#[rustler::nif]
fn set_memory_limit<'a>(
    env: Env<'a>,
    reference: Term<'a>,
    stream: StreamArg,
    limit: i64,
) -> NifResult<Term<'a>> {
    let limit = limit_arg("set_memory_limit", limit)?;
    // A limit of 0 makes every later allocation of the VM fail (MLX accepts it).
    if limit == 0 {
        return Err(crate::error::argument_error(
            "set_memory_limit: the limit must be a positive number of bytes, got 0",
        ));
    }
    on_worker(env, reference, &stream, "set_memory_limit", move || {
        ffi::memory_set_limit(limit).map_err(|e| mlx("set_memory_limit", e))
    })
}

/// `set_cache_limit(ref, stream, bytes)`: replies the previous limit. 0 disables the cache.
#[rustler::nif]
fn set_cache_limit<'a>(
    env: Env<'a>,
    reference: Term<'a>,
    stream: StreamArg,
    limit: i64,
) -> NifResult<Term<'a>> {
    let limit = limit_arg("set_cache_limit", limit)?;
    on_worker(env, reference, &stream, "set_cache_limit", move || {
        let previous = ffi::memory_set_cache_limit(limit).map_err(|e| mlx("set_cache_limit", e))?;
        CACHE_LIMIT.store(limit, Ordering::Release);
        Ok(previous)
    })
}

/// `set_wired_limit(ref, stream, bytes)`: replies the previous limit; an `Emily.Error`
/// where MLX does not run on Metal (the wired limit is a Metal setting).
#[rustler::nif]
fn set_wired_limit<'a>(
    env: Env<'a>,
    reference: Term<'a>,
    stream: StreamArg,
    limit: i64,
) -> NifResult<Term<'a>> {
    let limit = limit_arg("set_wired_limit", limit)?;
    on_worker(env, reference, &stream, "set_wired_limit", move || {
        let op = "set_wired_limit";
        if !ffi::metal_available().map_err(|e| mlx(op, e))? {
            return Err(Error::Mlx {
                op: op.into(),
                message: "the wired limit is a Metal setting, and this MLX does not run on Metal".into(),
                inputs: "none".into(),
            });
        }
        ffi::memory_set_wired_limit(limit).map_err(|e| mlx(op, e))
    })
}

/// `malloc_tune(mmap_threshold, trim_threshold)`: sets glibc malloc's `M_MMAP_THRESHOLD`
/// and `M_TRIM_THRESHOLD` (each left alone when negative); `false` where the C library is
/// not glibc or glibc refused a value. Not an MLX call: it runs here, on the scheduler.
///
/// MLX's CPU allocator is malloc. glibc raises its mmap threshold as a program frees
/// large blocks, so that buffers freed and allocated again are reused from the heap; the
/// BEAM sets malloc's trim threshold at boot, which turns that off and leaves the
/// threshold at 128 KiB. Every array above it is then a fresh mmap, faulted in page by
/// page and unmapped (with a TLB shootdown on every core) when freed, on every run.
#[rustler::nif]
fn malloc_tune(mmap_threshold: i64, trim_threshold: i64) -> NifResult<bool> {
    let arg = |v: i64, name: &str| {
        i32::try_from(v.max(-1)).map_err(|_| {
            crate::error::argument_error(format!("malloc_tune: {name} {v} does not fit in 32 bits"))
        })
    };
    Ok(ffi::malloc_tune(arg(mmap_threshold, "mmap_threshold")?, arg(trim_threshold, "trim_threshold")?))
}
