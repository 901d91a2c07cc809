//! Streams: an Elixir handle on a worker (one MLX stream on its own thread).
use crate::error::argument_error;
use crate::worker::{Device, Worker};
use rustler::{Atom, NifResult, Resource, ResourceArc};
use std::sync::Arc;

pub struct StreamResource {
    pub worker: Arc<Worker>,
}

#[rustler::resource_impl]
impl Resource for StreamResource {}

pub type StreamArg = ResourceArc<StreamResource>;

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
    let worker = Worker::spawn(device(dev)?).map_err(|e| argument_error(format!("stream_new: {e}")))?;
    Ok(ResourceArc::new(StreamResource { worker }))
}

/// `stream_device(stream)`: `:cpu` or `:gpu`.
#[rustler::nif]
fn stream_device(stream: StreamArg) -> Atom {
    match stream.worker.device {
        Device::Cpu => crate::atoms::cpu(),
        Device::Gpu => crate::atoms::gpu(),
    }
}

/// `stream_name(stream)`: the worker thread's name, e.g. `"emily-cpu-1"`.
#[rustler::nif]
fn stream_name(stream: StreamArg) -> String {
    stream.worker.name.clone()
}

/// `mlx_version()`: the version string of the libmlx Emily is linked against.
#[rustler::nif]
fn mlx_version() -> String {
    crate::bridge::ffi::mlx_version()
}
