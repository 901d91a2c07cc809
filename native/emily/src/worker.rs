//! Workers: one OS thread per MLX stream.
//!
//! MLX (>= 0.31) keeps streams and command encoders thread-local, so a graph must be
//! built and evaluated on the thread that owns its stream. A `Worker` is that thread: NIFs
//! only decode their arguments on the scheduler and queue a job; the worker builds the
//! graph node, evaluates, and replies to the caller with `{ref, result}` messages.
//!
//! Arrays never leave their worker: the worker keeps them in a map keyed by tensor id, and
//! an Elixir tensor is just `(worker, id)`. So a lazy op costs the caller one queue push,
//! and the worker builds nodes while the caller goes on (the performance targets of
//! `bench/` rest on this). Only evaluated arrays cross threads (`bridge::SendArray`).
//!
//! Dropping the last handle to a worker closes its queue; the thread drains the queue,
//! drops its arrays and stream, and is joined by the reaper thread, never by a scheduler.
//!
//! ## Cross-stream inputs, and why they cannot deadlock
//!
//! A lazy tensor of worker A used by an op on worker B is first evaluated on A: the NIF
//! queues an export job on A, then queues the op on B; B's job waits for the export's
//! one-shot reply before it builds its node. Only op jobs wait, and only on exports; an
//! export evaluates A's own graph, which never holds a lazy array of another worker (its
//! cross-stream inputs were resolved the same way when its nodes were built), so an export
//! never waits on another worker.
//!
//! Every wait points back in time: a job waits on an export queued *before* it (same NIF
//! call, in program order), and a queued job waits on the jobs ahead of it on its own
//! worker, which were queued before it. A cycle of waits would need a job queued strictly
//! before itself, so there is none: take the earliest-queued waiting job J; the export it
//! waits on is either running (and finishes: exports do not wait) or queued behind a job C
//! of A that was queued before the export, hence before J, and that is not waiting either
//! (J is the earliest waiting job), so C finishes and the export runs.
use crate::bridge::ffi;
use crate::error::Error;
use cxx::UniquePtr;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu = 0,
    Gpu = 1,
}

/// What a job sees: the worker's stream and the arrays it holds.
pub struct State {
    pub stream: UniquePtr<ffi::Stream>,
    pub arrays: HashMap<u64, Slot>,
    /// Programs compiled with `mx::compile` on this worker, by program id (never reused).
    /// MLX's compile cache is thread-local: they are built, called and dropped here only.
    pub compiled: HashMap<u64, UniquePtr<ffi::Compiled>>,
}

/// A tensor's value on its worker: the (possibly lazy) array, or why it has none.
pub enum Slot {
    Ready(UniquePtr<ffi::Array>),
    Failed(Arc<Error>),
}

impl State {
    /// The array for tensor `id`, or the error that `op` should report instead.
    pub fn get(&self, id: u64, op: &str) -> Result<&ffi::Array, Error> {
        match self.arrays.get(&id) {
            Some(Slot::Ready(a)) => Ok(a),
            Some(Slot::Failed(e)) => Err(Error::Input { op: op.into(), source: Box::new((**e).clone()) }),
            None => Err(Error::Released { op: op.into(), id }),
        }
    }

    pub fn put(&mut self, id: u64, value: Result<UniquePtr<ffi::Array>, Arc<Error>>) {
        let slot = match value {
            Ok(a) => Slot::Ready(a),
            Err(e) => Slot::Failed(e),
        };
        self.arrays.insert(id, slot);
    }
}

pub type Job = Box<dyn FnOnce(&mut State) + Send>;

pub struct Worker {
    tx: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pub device: Device,
    pub name: String,
}

static NEXT_TENSOR_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_WORKER: AtomicU64 = AtomicU64::new(1);

/// A fresh tensor id; ids are never reused.
pub fn next_id() -> u64 {
    NEXT_TENSOR_ID.fetch_add(1, Ordering::Relaxed)
}

impl Worker {
    /// Starts a worker thread with a new stream on `device`. Blocks until the stream exists
    /// (a thread spawn and `mx::new_stream`: call it from a dirty scheduler).
    pub fn spawn(device: Device) -> Result<Arc<Worker>, String> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let name = format!(
            "emily-{}-{}",
            if device == Device::Cpu { "cpu" } else { "gpu" },
            NEXT_WORKER.fetch_add(1, Ordering::Relaxed)
        );
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || run(device, rx, ready_tx))
            .map_err(|e| format!("cannot start worker thread: {e}"))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Arc::new(Worker {
                tx: Mutex::new(Some(tx)),
                thread: Mutex::new(Some(thread)),
                device,
                name,
            })),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err("worker thread died while starting".into()),
        }
    }

    /// Queues `job`. Jobs run in order; a job's panic is caught so the worker lives on.
    pub fn submit(&self, job: Job) {
        if let Some(tx) = self.tx.lock().unwrap().as_ref() {
            let _ = tx.send(job);
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx.lock().unwrap().take();
        if let Some(handle) = self.thread.lock().unwrap().take() {
            reaper().lock().unwrap().send(handle).ok();
        }
    }
}

fn run(device: Device, rx: Receiver<Job>, ready: Sender<Result<(), String>>) {
    let stream = match ffi::device_available(device as i32) {
        Ok(true) => ffi::stream_new(device as i32).map_err(|e| e.what().to_string()),
        Ok(false) => Err(format!("device {device:?} is not available in this MLX build")),
        Err(e) => Err(e.what().to_string()),
    };
    let stream = match stream {
        Ok(s) => {
            let _ = ready.send(Ok(()));
            s
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut state = State { stream, arrays: HashMap::new(), compiled: HashMap::new() };
    while let Ok(job) = rx.recv() {
        // MLX errors arrive as Results; a panic here would be a bug in Emily, and must
        // not take the VM down with it.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut state)));
    }
    // Compiled programs first: their cache entries live in this thread's compile cache.
    state.compiled.clear();
    drop(state);
}

/// Joins finished worker threads off the schedulers.
fn reaper() -> &'static Mutex<Sender<JoinHandle<()>>> {
    static REAPER: OnceLock<Mutex<Sender<JoinHandle<()>>>> = OnceLock::new();
    REAPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<JoinHandle<()>>();
        std::thread::Builder::new()
            .name("emily-reaper".into())
            .spawn(move || {
                for h in rx {
                    let _ = h.join();
                }
            })
            .expect("reaper thread");
        Mutex::new(tx)
    })
}
