//! Workers: one OS thread per MLX stream.
//!
//! MLX (>= 0.31) keeps streams and command encoders thread-local, so a graph must be
//! built and evaluated on the thread that owns its stream. A `Worker` is that thread: NIFs
//! only decode their arguments on the scheduler and queue a job; the worker builds the
//! graph node, evaluates, and replies to the caller with `{ref, result}` messages.
//!
//! Arrays never leave their worker: the worker keeps them in a map keyed by tensor id, and
//! an Elixir tensor is just `(worker, id)`. So a lazy op costs the caller one lock-free
//! queue push (the performance targets of `bench/` rest on this); the worker builds the
//! queued nodes when it is woken: by a job that needs a value, or every `LAZY_BATCH` ops.
//! Only evaluated arrays cross threads (`bridge::SendArray`).
//!
//! Dropping the last handle to a worker (its stream and every tensor made on it) closes
//! its queue and puts its thread back in an idle pool, with its MLX stream, at once; the
//! thread drains the queue and drops its arrays before it takes its next session. The
//! next new stream on that device takes an idle thread instead of
//! starting one, even one still ending its last session. MLX never reclaims a stream
//! (nor, on the CPU, the OS thread that runs its kernels), so reusing threads is what
//! keeps the set of threads that call MLX bounded by the most streams ever alive at
//! once, however many streams come and go. Each thread also makes its stream its MLX
//! default, so that MLX code that falls back to the default stream does not create
//! another one.
//!
//! One path bypasses the workers: `program_eval` (src/ops/program.rs) builds and
//! evaluates a whole program inside one dirty-scheduler NIF call, on that thread's own
//! default stream, from evaluated inputs, so nothing lazy outlives the call or crosses a
//! thread; `program_eval_async` does the same for a CPU program that MLX takes quickly,
//! on a normal scheduler, and may leave MLX's thread to finish the evaluation (its
//! outputs are read only once that thread says they are computed). The schedulers are a
//! fixed set of threads, so the streams they leave behind stay few. `run_busy` and
//! `Busy` count such calls and evaluations in the exit guard below.
//!
//! ## Cross-stream inputs, and why they cannot deadlock
//!
//! A lazy tensor of worker A used by an op on worker B is first evaluated on A: the NIF
//! queues an export job on A, then queues the op on B; B's job waits for the export's
//! one-shot reply before it builds its node. Only op (and program) jobs wait, and only on
//! exports, which are queued with a wake-up. An export evaluates A's own graph, which
//! never holds a lazy array of another worker (its cross-stream inputs were resolved the
//! same way when its nodes were built), so an export never waits on another worker.
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
use crate::queue::Queue;
use cxx::UniquePtr;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{fence, AtomicBool, AtomicUsize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::Thread;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu = 0,
    Gpu = 1,
}

/// Hashes an id (tensor and program ids are unique counters) by one multiplication: a
/// worker looks up, inserts and removes a few per op, and the default SipHash cost as much
/// as a good part of building the op's node.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ b as u64);
        }
    }

    fn write_u64(&mut self, id: u64) {
        // Odd, so distinct ids keep distinct low bits (the bucket); the high bits (the
        // table's tag) mix all of the id's.
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by id.
pub type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// What a job sees: the worker's stream and the arrays it holds.
pub struct State {
    pub stream: UniquePtr<ffi::Stream>,
    pub arrays: Arrays,
    /// An op job's argument and result arrays, reused from op to op (emptied after each),
    /// so that building a node allocates no vectors.
    pub op_args: UniquePtr<ffi::ArrayVec>,
    pub op_results: UniquePtr<ffi::ArrayVec>,
}

/// A tensor's value on its worker: the (possibly lazy) array, or why it has none.
pub enum Slot {
    Ready(UniquePtr<ffi::Array>),
    Failed(Arc<Error>),
}

/// The arrays a worker holds, by tensor id.
#[derive(Default)]
pub struct Arrays(IdMap<Slot>);

impl Arrays {
    /// The array for tensor `id`, or the error that `op` should report instead.
    pub fn get(&self, id: u64, op: &str) -> Result<&ffi::Array, Error> {
        match self.0.get(&id) {
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
        self.0.insert(id, slot);
    }

    pub fn remove(&mut self, id: u64) {
        self.0.remove(&id);
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

pub type Job = Box<dyn FnOnce(&mut State) + Send>;

/// A queued job, and whether a caller waits for it (anything but a lazy op or a drop).
struct Queued {
    job: Job,
    waited: bool,
}

/// Lazy jobs queued before the worker is woken anyway (bounds the work a wait finds).
const LAZY_BATCH: usize = 32;

/// The worker side of a session: its queue, and the flag that says it is asleep.
///
/// Lazy ops are queued without waking a sleeping worker: it builds their nodes when
/// something needs a value, or when `LAZY_BATCH` are pending. Waking a thread for each op
/// would cost a context switch per op, and on a busy machine every woken worker competes
/// with the BEAM's scheduler threads for a core. Queueing is lock-free (`queue.rs`), so a
/// scheduler never waits for a worker that the OS has descheduled.
struct Session {
    queue: Arc<Queue<Queued>>,
    /// Jobs taken from the queue, not run yet, oldest first.
    taken: VecDeque<Queued>,
    sleeping: Arc<AtomicBool>,
}

impl Session {
    /// The oldest job not yet run, if any has been queued.
    fn try_next(&mut self) -> Option<Queued> {
        if self.taken.is_empty() {
            self.queue.take_into(&mut self.taken);
        }
        self.taken.pop_front()
    }

    /// Whether the session is over: its worker handle is gone and every job it queued has
    /// been taken. (Call it after `try_next` found nothing: the close comes after the last
    /// push, so a queue seen closed is taken once more.)
    fn is_over(&mut self) -> bool {
        if !self.queue.is_closed() {
            return false;
        }
        self.queue.take_into(&mut self.taken);
        self.taken.is_empty()
    }
}

/// An Emily stream's handle on the thread that serves it. Dropping the last one ends the
/// thread's session (see the module doc).
pub struct Worker {
    queue: Arc<Queue<Queued>>,
    thread: Thread,
    /// Hands the thread its next session; the thread takes it when this one is over.
    handoff: Sender<Session>,
    sleeping: Arc<AtomicBool>,
    lazy: AtomicUsize,
    pub device: Device,
    pub name: String,
}

static NEXT_TENSOR_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

/// A fresh tensor id; ids are never reused.
pub fn next_id() -> u64 {
    next_ids(1).start
}

/// `n` consecutive fresh ids (a job then names its outputs by a range, not a list).
pub fn next_ids(n: usize) -> std::ops::Range<u64> {
    let first = NEXT_TENSOR_ID.fetch_add(n as u64, Ordering::Relaxed);
    first..first + n as u64
}

/// A worker thread whose stream is gone: waiting for its next session's queue, or still
/// ending the last session (it takes the next one when done).
struct Idle {
    device: Device,
    handoff: Sender<Session>,
    thread: Thread,
}

fn idle() -> &'static Mutex<Vec<Idle>> {
    static IDLE: Mutex<Vec<Idle>> = Mutex::new(Vec::new());
    &IDLE
}

/// Set at process exit: workers run no more jobs (see `quiesce`).
static EXITING: AtomicBool = AtomicBool::new(false);
/// Worker threads running a job now.
static BUSY: AtomicUsize = AtomicUsize::new(0);

/// At process exit, C++ destroys MLX's static objects (its allocator among them) while
/// worker threads may still be using them, which corrupts the heap. This runs first (an
/// exit handler registered after those objects were built): from now on workers start
/// no job, and this waits, up to `limit`, for the running ones to finish.
pub fn quiesce(limit: std::time::Duration) {
    EXITING.store(true, Ordering::SeqCst);
    let deadline = std::time::Instant::now() + limit;
    while BUSY.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Marks this thread busy and hands `work` back, unless the process is exiting: then
/// `work` (a job, or a session's arrays) is never used nor dropped, since MLX's statics
/// are being destroyed, and the thread stops for good.
fn enter_busy<T>(work: T) -> T {
    BUSY.fetch_add(1, Ordering::SeqCst);
    if EXITING.load(Ordering::SeqCst) {
        BUSY.fetch_sub(1, Ordering::SeqCst);
        std::mem::forget(work);
        loop {
            std::thread::park();
        }
    }
    work
}

/// Runs `f` on this (non-worker) thread as a job would run, counted busy so that process
/// exit waits for it (see `enter_busy`).
pub fn run_busy<R>(f: impl FnOnce() -> R) -> R {
    let _busy = Busy::enter();
    f()
}

/// Counts work that MLX goes on with after a NIF returned (an asynchronous evaluation)
/// as busy until dropped, so that process exit waits for it too.
pub struct Busy(());

impl Busy {
    pub fn enter() -> Busy {
        enter_busy(Busy(()))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs `job`, unless the process is exiting (see `enter_busy`).
fn run_job(job: Job, state: &mut State) {
    let job = enter_busy(job);
    // MLX errors arrive as Results; a panic here would be a bug in Emily, and must not
    // take the VM down with it.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(state)));
    BUSY.fetch_sub(1, Ordering::SeqCst);
}

/// A worker thread's stack. mx::compile's tracing recurses along a graph (some 200 bytes
/// a level: src/ops/program.rs, `compiles_here`), so this bounds the depth of the graphs
/// a worker compiles, some 32,000 levels; a deeper one runs uncompiled. Reserved, not
/// committed: only the pages a thread touches take memory.
const WORKER_STACK: usize = 16 << 20;

/// Threads started so far, by device (they never stop while the VM runs).
static THREADS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// `(threads started, threads idle)` for `device`.
pub fn pool_stats(device: Device) -> (u64, u64) {
    let idle = idle().lock().unwrap().iter().filter(|i| i.device == device).count() as u64;
    (THREADS[device as usize].load(Ordering::Relaxed), idle)
}

fn device_name(device: Device) -> &'static str {
    if device == Device::Cpu {
        "cpu"
    } else {
        "gpu"
    }
}

impl Worker {
    /// A worker for a new stream on `device`: an idle thread if there is one, else a new
    /// thread with a new MLX stream. Starting a thread blocks until its stream exists
    /// (call it from a dirty scheduler).
    pub fn spawn(device: Device) -> Result<Arc<Worker>, String> {
        let queue = Arc::new(Queue::default());
        let sleeping = Arc::new(AtomicBool::new(false));
        let name = format!("emily-{}-{}", device_name(device), NEXT_STREAM.fetch_add(1, Ordering::Relaxed));
        let worker = |thread, handoff| {
            Arc::new(Worker {
                queue: queue.clone(),
                thread,
                handoff,
                sleeping: sleeping.clone(),
                lazy: AtomicUsize::new(0),
                device,
                name: name.clone(),
            })
        };
        let mut session =
            Session { queue: queue.clone(), taken: VecDeque::new(), sleeping: sleeping.clone() };
        loop {
            let reuse = {
                let mut idle = idle().lock().unwrap();
                idle.iter().rposition(|i| i.device == device).map(|k| idle.swap_remove(k))
            };
            let Some(idle) = reuse else { break };
            match idle.handoff.send(session) {
                Ok(()) => return Ok(worker(idle.thread, idle.handoff)),
                // That thread is gone (it cannot be while the VM runs); try another.
                Err(mpsc::SendError(back)) => session = back,
            }
        }
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let (handoff, next) = mpsc::channel::<Session>();
        let thread_name =
            format!("emily-{}-t{}", device_name(device), NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
        let handle = std::thread::Builder::new()
            .name(thread_name)
            .stack_size(WORKER_STACK)
            .spawn(move || run(device, session, next, ready_tx))
            .map_err(|e| format!("cannot start worker thread: {e}"))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {
                THREADS[device as usize].fetch_add(1, Ordering::Relaxed);
                Ok(worker(handle.thread().clone(), handoff))
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err("worker thread died while starting".into()),
        }
    }

    /// Queues `job` and wakes the worker. Jobs run in order; a job's panic is caught so
    /// the worker lives on.
    pub fn submit(&self, job: Job) {
        self.push(job, false);
    }

    /// Queues a lazy op's job: it runs before any later job, but does not wake the worker
    /// by itself (see `Session`).
    pub fn submit_lazy(&self, job: Job) {
        self.push(job, true);
    }

    fn push(&self, job: Job, lazy: bool) {
        self.queue.push(Queued { job, waited: !lazy });
        if lazy && !(self.lazy.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(LAZY_BATCH) {
            return;
        }
        // Pairs with the worker's store before its last look at the queue: either it sees
        // this job, or this sees it asleep (see `next_job`).
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.thread.unpark();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Ends the session once the thread has run what is queued; nothing waits here. The
        // thread is free for a new stream now: a session handed to it waits for this one to
        // end, so no stream starts a thread while a dropped one's is still busy.
        self.queue.close();
        self.thread.unpark();
        idle().lock().unwrap().push(Idle {
            device: self.device,
            handoff: self.handoff.clone(),
            thread: self.thread.clone(),
        });
    }
}

/// How long a worker polls its queue after a job someone waited for, before it sleeps,
/// in nanoseconds (0: never polls). See `set_spin`.
static SPIN_NS: AtomicU64 = AtomicU64::new(0);

/// Sets how long a worker polls its queue after a job that a caller waited for.
///
/// Waking a sleeping thread takes the OS several microseconds, twice per round trip
/// (caller to worker, worker back to the caller), which is most of what a one-op
/// evaluation costs beyond MLX's own work. A caller that has just been answered often
/// asks again at once: a worker that polls for a while then picks the next request up
/// without being woken. The window opens only after waited-for jobs: a stream of lazy
/// ops is still drained in batches (`LAZY_BATCH`), not raced op by op. The price is a
/// core kept busy meanwhile: on a machine without cores to spare, the poll delays the
/// very threads (MLX's, the BEAM's) that the caller waits on.
pub fn set_spin(d: std::time::Duration) {
    SPIN_NS.store(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
}

pub fn spin() -> std::time::Duration {
    std::time::Duration::from_nanos(SPIN_NS.load(Ordering::Relaxed))
}

/// Polls the queue until `deadline`; `None` if nothing came in by then (or the session
/// ended).
fn poll(session: &mut Session, deadline: std::time::Instant) -> Option<Queued> {
    loop {
        for _ in 0..64 {
            if !session.queue.is_empty() {
                return session.try_next();
            }
            if session.queue.is_closed() {
                return None;
            }
            std::hint::spin_loop();
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
    }
}

/// The session's next job, sleeping while there is none; `None` once it is over. Polls
/// first while `window` (the polling window after a waited-for job) is open.
fn next_job(session: &mut Session, window: Option<std::time::Instant>) -> Option<Queued> {
    loop {
        if let Some(job) = session.try_next() {
            return Some(job);
        }
        if session.is_over() {
            return None;
        }
        if let Some(deadline) = window.filter(|&d| std::time::Instant::now() < d) {
            if let Some(job) = poll(session, deadline) {
                return Some(job);
            }
        }
        // Out of jobs: a loaded array that a release left to the registry alone goes now.
        ffi::loads_prune();
        session.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // Woken by a job that needs running, by the session's end, or spuriously.
        if session.queue.is_empty() && !session.queue.is_closed() {
            std::thread::park();
        }
        session.sleeping.store(false, Ordering::SeqCst);
    }
}

fn run(device: Device, first: Session, next: Receiver<Session>, ready: Sender<Result<(), String>>) {
    let stream = match ffi::device_available(device as i32) {
        Ok(true) => ffi::stream_new(device as i32).map_err(|e| e.what().to_string()),
        Ok(false) => Err(format!("device {device:?} is not available in this MLX build")),
        Err(e) => Err(e.what().to_string()),
    };
    // The thread's stream becomes its MLX default (MLX code that falls back to the default
    // stream then makes no other), and the exit guard is installed once MLX is up.
    let stream = stream.and_then(|s| {
        ffi::stream_set_default(&s)
            .and_then(|_| ffi::install_exit_guard())
            .map(|_| s)
            .map_err(|e| e.what().to_string())
    });
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
    let mut state = State {
        stream,
        arrays: Arrays::default(),
        op_args: ffi::array_vec_new(4),
        op_results: ffi::array_vec_new(4),
    };
    let mut session = first;
    loop {
        let mut window = None;
        while let Some(Queued { job, waited }) = next_job(&mut session, window) {
            run_job(job, &mut state);
            if waited {
                let spin = SPIN_NS.load(Ordering::Relaxed);
                window =
                    (spin > 0).then(|| std::time::Instant::now() + std::time::Duration::from_nanos(spin));
            }
        }
        // The session is over: every handle is gone, so nothing can name these any more.
        state = enter_busy(state);
        state.arrays.clear();
        ffi::loads_clear();
        // Waits for the stream's last kernels, and takes any error they left behind (an
        // async_eval nobody waited for) so that the next session starts clean.
        let _ = ffi::synchronize(&state.stream);
        BUSY.fetch_sub(1, Ordering::SeqCst);
        // The worker's drop has listed this thread as idle already.
        match next.recv() {
            Ok(next) => session = next,
            Err(_) => break,
        }
    }
}
