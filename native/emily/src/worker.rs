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
//! Lazy ops do not wake the worker: they only join its queue. A waiting call (eval,
//! to_binary, ...) wakes it, and so does a queue grown to `WAKE_AT` jobs, so the worker
//! then builds a whole chain of nodes in one go instead of paying a thread wake-up per op.
//!
//! Dropping the last handle to a worker closes its queue; the thread drains the queue,
//! drops its arrays and stream, and is joined by the reaper thread, never by a scheduler.
use crate::bridge::ffi;
use crate::error::Error;
use cxx::UniquePtr;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu = 0,
    Gpu = 1,
}

/// What a job sees: the worker's stream and the arrays it holds.
pub struct State {
    pub stream: UniquePtr<ffi::Stream>,
    pub arrays: HashMap<u64, Slot>,
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

/// Lazy jobs queued beyond this many wake the worker anyway, so that long chains overlap
/// with the caller instead of piling up.
const WAKE_AT: usize = 64;

/// After running its jobs, a worker polls for more this long before sleeping: a caller
/// that waits on a result usually sends the next request within microseconds.
const SPIN: Duration = Duration::from_micros(50);

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

pub struct Worker {
    shared: Arc<Shared>,
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
        let shared = Arc::new(Shared { queue: Mutex::new(Queue::default()), ready: Condvar::new() });
        let queue = shared.clone();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let name = format!(
            "emily-{}-{}",
            if device == Device::Cpu { "cpu" } else { "gpu" },
            NEXT_WORKER.fetch_add(1, Ordering::Relaxed)
        );
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || run(device, &queue, ready_tx))
            .map_err(|e| format!("cannot start worker thread: {e}"))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Arc::new(Worker { shared, thread: Mutex::new(Some(thread)), device, name })),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err("worker thread died while starting".into()),
        }
    }

    /// Queues a lazy job (building a node, dropping an array): it runs before any later
    /// job, but nothing waits for it, so the worker is not woken for it alone.
    pub fn submit(&self, job: Job) {
        self.push(job, false)
    }

    /// Queues a job someone waits for, and wakes the worker.
    pub fn submit_now(&self, job: Job) {
        self.push(job, true)
    }

    fn push(&self, job: Job, wake: bool) {
        let mut q = self.shared.queue.lock().unwrap();
        if q.closed {
            return;
        }
        q.jobs.push_back(job);
        let wake = wake || q.jobs.len() >= WAKE_AT;
        drop(q);
        if wake {
            self.shared.ready.notify_one();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shared.queue.lock().unwrap().closed = true;
        self.shared.ready.notify_one();
        if let Some(handle) = self.thread.lock().unwrap().take() {
            reaper().lock().unwrap().send(handle).ok();
        }
    }
}

fn run(device: Device, shared: &Shared, ready: Sender<Result<(), String>>) {
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
    let mut state = State { stream, arrays: HashMap::new() };
    let mut batch = VecDeque::new();
    loop {
        {
            let mut q = shared.queue.lock().unwrap();
            if q.jobs.is_empty() && !q.closed {
                drop(q);
                spin(shared);
                q = shared.queue.lock().unwrap();
            }
            while q.jobs.is_empty() && !q.closed {
                q = shared.ready.wait(q).unwrap();
            }
            if q.jobs.is_empty() && q.closed {
                break;
            }
            std::mem::swap(&mut q.jobs, &mut batch);
        }
        for job in batch.drain(..) {
            // MLX errors arrive as Results; a panic here would be a bug in Emily, and must
            // not take the VM down with it.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut state)));
        }
    }
    drop(state);
}

/// Polls the queue for up to `SPIN` before the worker goes to sleep.
fn spin(shared: &Shared) {
    let start = Instant::now();
    while start.elapsed() < SPIN {
        if let Ok(q) = shared.queue.try_lock() {
            if !q.jobs.is_empty() || q.closed {
                return;
            }
        }
        std::hint::spin_loop();
    }
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
