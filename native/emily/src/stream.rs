//! Streams: an Elixir handle on a worker (one MLX stream on its own thread).
//!
//! A handle can be released (`stream_release`): from then on it refuses new work with an
//! `ArgumentError`, and it no longer keeps the worker alive. Tensors made on the stream
//! keep their worker, so they stay readable and usable as inputs on other streams; the
//! thread is free for another stream once the handle is released (or garbage) and the
//! last of them is garbage.
use crate::error::argument_error;
use crate::worker::{Device, Worker};
use rustler::{Atom, NifResult, Resource, ResourceArc};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

pub struct StreamResource {
    worker: RwLock<Option<Arc<Worker>>>,
    /// Set by `stream_pin`: the stream is one every caller may rely on (a default
    /// stream), and `stream_release` refuses it.
    pinned: AtomicBool,
    pub device: Device,
    pub name: String,
}

#[rustler::resource_impl]
impl Resource for StreamResource {}

pub type StreamArg = ResourceArc<StreamResource>;

impl StreamResource {
    /// The stream's worker, or `None` once the stream has been released.
    pub fn get(&self) -> Option<Arc<Worker>> {
        self.worker.read().unwrap().clone()
    }

    /// The stream's worker; an `ArgumentError` naming `op` once it has been released.
    pub fn worker(&self, op: &str) -> NifResult<Arc<Worker>> {
        self.get().ok_or_else(|| released_error(op, &self.name))
    }
}

pub fn released_error(op: &str, name: &str) -> rustler::Error {
    argument_error(format!("{op}: stream {name} has been released"))
}

fn device(a: Atom) -> NifResult<Device> {
    if a == crate::atoms::cpu() {
        Ok(Device::Cpu)
    } else if a == crate::atoms::gpu() {
        Ok(Device::Gpu)
    } else {
        Err(argument_error(format!("unknown device {a:?}; expected :cpu or :gpu")))
    }
}

/// `stream_new(device)`: a new worker thread with its own MLX stream. Raises
/// `ArgumentError` if MLX has no such device.
#[rustler::nif(schedule = "DirtyCpu")]
fn stream_new(dev: Atom) -> NifResult<StreamArg> {
    let device = device(dev)?;
    let worker = Worker::spawn(device).map_err(|e| argument_error(format!("stream_new: {e}")))?;
    let name = worker.name.clone();
    Ok(ResourceArc::new(StreamResource {
        worker: RwLock::new(Some(worker)),
        pinned: AtomicBool::new(false),
        device,
        name,
    }))
}

/// `stream_release(stream)`: closes the stream to new work (idempotent). Work already
/// queued runs to completion. A pinned stream (a default stream) is refused with an
/// `ArgumentError`: releasing it would break every later op on it, VM-wide.
#[rustler::nif]
fn stream_release(stream: StreamArg) -> NifResult<Atom> {
    if stream.pinned.load(Ordering::Acquire) {
        return Err(argument_error(format!(
            "stream_release: {} is a default stream and cannot be released",
            stream.name
        )));
    }
    let worker = stream.worker.write().unwrap().take();
    // The worker's queue may drop the last handle: never join a thread here.
    drop(worker);
    Ok(crate::atoms::ok())
}

/// `stream_pin(stream)`: marks the stream as one `stream_release` refuses (the
/// application pins its default streams). Irreversible; an `ArgumentError` if the stream
/// was already released.
#[rustler::nif]
fn stream_pin(stream: StreamArg) -> NifResult<Atom> {
    // Holding the lock (release takes it to write), so a concurrent release either
    // happened before (refused here) or sees the pin.
    let guard = stream.worker.read().unwrap();
    if guard.is_none() {
        return Err(released_error("stream_pin", &stream.name));
    }
    stream.pinned.store(true, Ordering::Release);
    Ok(crate::atoms::ok())
}

/// `stream_released(stream)`: whether `stream_release` was called on it.
#[rustler::nif]
fn stream_released(stream: StreamArg) -> bool {
    stream.get().is_none()
}

/// `stream_threads(device)`: `{started, idle}`, the worker threads started so far for
/// `device` (they serve one stream at a time and are reused, never stopped) and how many
/// of them wait for a stream now.
#[rustler::nif]
fn stream_threads(dev: Atom) -> NifResult<(u64, u64)> {
    Ok(crate::worker::pool_stats(device(dev)?))
}

/// `stream_device(stream)`: `:cpu` or `:gpu`.
#[rustler::nif]
fn stream_device(stream: StreamArg) -> Atom {
    match stream.device {
        Device::Cpu => crate::atoms::cpu(),
        Device::Gpu => crate::atoms::gpu(),
    }
}

/// `stream_name(stream)`: the worker thread's name, e.g. `"emily-cpu-1"`.
#[rustler::nif]
fn stream_name(stream: StreamArg) -> String {
    stream.name.clone()
}

/// `mlx_version()`: the version string of the libmlx Emily is linked against.
#[rustler::nif]
fn mlx_version() -> String {
    crate::bridge::ffi::mlx_version()
}

/// `cuda_kernels()`: whether Emily's own CUDA kernels (a decoding step's products and
/// attention) run here: a CUDA build with a GPU, NVRTC and MLX's device allocator found.
/// Elsewhere MLX's own ops compute the same.
#[rustler::nif]
fn cuda_kernels() -> bool {
    crate::bridge::ffi::cuda_kernels_available()
}

/// `stream_set_spin(microseconds)`: how long an idle worker thread polls its queue before
/// it sleeps, for every stream (see `Emily.Stream.set_spin/1`). Returns the previous value.
#[rustler::nif]
fn stream_set_spin(microseconds: i64) -> NifResult<i64> {
    if !(0..=1_000_000).contains(&microseconds) {
        return Err(argument_error(format!(
            "stream_set_spin: expected 0 to 1000000 microseconds, got {microseconds}"
        )));
    }
    let previous = crate::worker::spin().as_micros() as i64;
    crate::worker::set_spin(std::time::Duration::from_micros(microseconds as u64));
    Ok(previous)
}
