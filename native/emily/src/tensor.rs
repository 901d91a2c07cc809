//! The tensor resource and the NIFs that wait for values: `from_binary`, `eval`,
//! `to_binary`, `describe`.
//!
//! A tensor is `(worker, id)`; its array lives on the worker (see `worker.rs`). Once a
//! tensor has been evaluated, a copy of its evaluated array is kept here too, so other
//! workers can read it and `to_binary` can hand out its bytes without copying.
use crate::bridge::{ffi, SendArray};
use crate::dtype::DType;
use crate::error::{argument_error, Error};
use crate::stream::StreamArg;
use crate::term::{List, Live, Shape};
use crate::worker::{next_id, next_ids, State, Worker};
use rustler::env::SavedTerm;
use rustler::{Binary, Encoder, Env, LocalPid, NifResult, OwnedEnv, Resource, ResourceArc, Term};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};

pub struct TensorResource {
    pub id: u64,
    pub worker: Arc<Worker>,
    /// Whether the worker's map holds the array under `id` (every tensor but those whose
    /// value was computed off the worker, `from_evaluated`).
    pub held: bool,
    /// The evaluated array, once some eval/to_binary has produced it (`None` again once
    /// the tensor is released).
    evaluated: Mutex<Option<Arc<SendArray>>>,
    released: AtomicBool,
}

#[rustler::resource_impl]
impl Resource for TensorResource {}

pub type TensorArg = ResourceArc<TensorResource>;

impl TensorResource {
    pub fn new(worker: &Arc<Worker>) -> TensorArg {
        Self::with(worker, next_id(), true, None)
    }

    /// `n` tensors of `worker` for a job's outputs, and their ids.
    pub fn outputs(worker: &Arc<Worker>, n: usize) -> (Vec<TensorArg>, Range<u64>) {
        let ids = next_ids(n);
        (ids.clone().map(|id| Self::with(worker, id, true, None)).collect(), ids)
    }

    fn with(worker: &Arc<Worker>, id: u64, held: bool, evaluated: Option<Arc<SendArray>>) -> TensorArg {
        ResourceArc::new(TensorResource {
            id,
            worker: worker.clone(),
            held,
            evaluated: Mutex::new(evaluated),
            released: AtomicBool::new(false),
        })
    }

    /// A tensor of `worker` whose evaluated array `a` was computed elsewhere. It is only
    /// ever read through its evaluated slot (`Inputs::push`, `eval`, `to_binary`,
    /// `describe`), so the worker's map need not hold it.
    pub fn from_evaluated(worker: &Arc<Worker>, a: cxx::UniquePtr<ffi::Array>) -> TensorArg {
        Self::with(worker, next_id(), false, Some(Arc::new(SendArray(a))))
    }

    /// The evaluated array, if some eval/to_binary has produced it.
    pub fn evaluated(&self) -> Option<Arc<SendArray>> {
        self.evaluated.lock().unwrap().clone()
    }

    /// Records `a` as the evaluated array unless one already is (and the tensor is live);
    /// returns the one recorded.
    fn set_evaluated(&self, a: Arc<SendArray>) -> Arc<SendArray> {
        let mut slot = self.evaluated.lock().unwrap();
        if self.released.load(Ordering::Acquire) {
            return a;
        }
        slot.get_or_insert(a).clone()
    }

    /// Drops this handle's hold on its array now rather than when the BEAM collects it:
    /// `false` if it was released already.
    pub fn release(&self) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        let evaluated = self.evaluated.lock().unwrap().take();
        let id = self.id;
        self.worker.submit_lazy(Box::new(move |st: &mut State| {
            st.arrays.remove(id);
            drop(evaluated);
            ffi::loads_released();
        }));
        true
    }
}

impl Drop for TensorResource {
    fn drop(&mut self) {
        // Unless released already: the array is freed on its worker, nobody waiting.
        self.release();
    }
}

/// The bytes of an evaluated, row-contiguous array, exported as a resource binary.
pub struct ExportResource {
    array: Option<Arc<SendArray>>,
    worker: Arc<Worker>,
}

#[rustler::resource_impl]
impl Resource for ExportResource {}

impl Drop for ExportResource {
    fn drop(&mut self) {
        let a = self.array.take();
        self.worker.submit_lazy(Box::new(move |_| drop(a)));
    }
}

/// Replies `{ref, result}` to the calling process from a worker.
pub struct Reply {
    env: OwnedEnv,
    reference: SavedTerm,
    pid: LocalPid,
}

impl Reply {
    pub fn new(env: Env, reference: Term) -> Reply {
        let owned = OwnedEnv::new();
        let saved = owned.save(reference);
        Reply { env: owned, reference: saved, pid: env.pid() }
    }

    pub fn send<F>(mut self, f: F)
    where
        F: for<'a> FnOnce(Env<'a>) -> Term<'a>,
    {
        let reference = self.reference;
        let _ = self.env.send_and_clear(&self.pid, |env| (reference.load(env), f(env)).encode(env));
    }

    pub fn send_result<T: Encoder>(self, r: Result<T, Error>) {
        self.send(|env| match r {
            Ok(v) => (crate::atoms::ok(), v).encode(env),
            Err(e) => (crate::atoms::error(), e.to_exception()).encode(env),
        })
    }
}

/// Makes sure `t` is evaluated on its worker and records the evaluated array.
pub(crate) fn evaluate(st: &mut State, t: &TensorArg, op: &str) -> Result<Arc<SendArray>, Error> {
    if let Some(a) = t.evaluated() {
        return Ok(a);
    }
    let arr = st.arrays.get(t.id, op)?;
    let res = ffi::export_array(arr, &st.stream).map_err(|e| mlx_error(op, e, &[arr]))?;
    Ok(record_evaluated(st, t, res))
}

/// Records `a`, `t`'s evaluated array, in `t` and in the worker's own slot, so that later
/// ops on it start from data rather than from the graph.
fn record_evaluated(st: &mut State, t: &TensorArg, a: cxx::UniquePtr<ffi::Array>) -> Arc<SendArray> {
    let shared = Arc::new(SendArray(a));
    st.arrays.put(t.id, Ok(ffi::clone_array(&shared.0)));
    t.set_evaluated(shared)
}

pub fn mlx_error(op: &str, e: cxx::Exception, inputs: &[&ffi::Array]) -> Error {
    mlx_error_message(op, e.what(), inputs)
}

/// `mlx_error` for a message MLX reported some other way (an asynchronous evaluation's).
pub fn mlx_error_message(op: &str, message: &str, inputs: &[&ffi::Array]) -> Error {
    let described: Vec<(Vec<i32>, String)> = inputs
        .iter()
        .map(|a| {
            let dt = DType::from_val(ffi::array_dtype_val(a))
                .map(|d| d.short_name())
                .unwrap_or_else(|| "?".into());
            (ffi::array_shape(a), dt)
        })
        .collect();
    Error::Mlx { op: op.into(), message: message.to_string(), inputs: crate::error::describe(&described) }
}

/// `from_binary(stream, binary, shape, dtype)`: one copy into a new MLX array, or, for a
/// large binary whose bytes a live tensor of the worker was loaded from, that tensor's
/// array (see `cpp/loads.h`).
#[rustler::nif]
fn from_binary<'a>(
    stream: Live<StreamArg>,
    data: Term<'a>,
    shape: Shape,
    dtype: DType,
) -> NifResult<TensorArg> {
    let Live(stream) = stream;
    let bin: Binary = data.decode().map_err(|_| argument_error("from_binary: expected a binary"))?;
    let want = shape.size().and_then(|n| n.checked_mul(dtype.size as u64));
    if want != Some(bin.len() as u64) {
        return Err(argument_error(format!(
            "from_binary: {} bytes do not hold a {} tensor of shape {:?} ({} bytes)",
            bin.len(),
            dtype.short_name(),
            shape.0,
            want.map(|w| w.to_string()).unwrap_or_else(|| "overflow".into())
        )));
    }
    let worker = stream.worker("from_binary")?;
    let out = TensorResource::new(&worker);
    let id = out.id;
    // Keep the binary alive by reference (no copy) until the worker has read it.
    let owned = OwnedEnv::new();
    let saved = owned.save(data);
    let dims: Vec<i32> = shape.0.iter().map(|&d| d as i32).collect();
    worker.submit_lazy(Box::new(move |st: &mut State| {
        let arr = owned.run(|env| {
            let bin: Binary = saved.load(env).decode().expect("saved binary");
            ffi::from_bytes(bin.as_slice(), &dims, dtype.val, dtype.size)
        });
        let value = arr.map_err(|e| {
            Arc::new(Error::Mlx {
                op: "from_binary".into(),
                message: e.what().into(),
                inputs: format!("{}[{:?}]", dtype.short_name(), dims),
            })
        });
        st.arrays.put(id, value);
    }));
    Ok(out)
}

/// Queues a job on `t`'s own worker that evaluates it and hands the evaluated array to the
/// returned one-shot: how a lazy tensor reaches an op of another worker (see `worker.rs`
/// for why waiting on it cannot deadlock). `op` names the consuming op in errors.
pub(crate) fn request_export(t: &TensorArg, op: &'static str) -> Receiver<Result<Arc<SendArray>, Error>> {
    let (tx, rx) = mpsc::sync_channel(1);
    if let Some(a) = t.evaluated() {
        let _ = tx.send(Ok(a));
        return rx;
    }
    let t2 = t.clone();
    t.worker.submit(Box::new(move |st: &mut State| {
        let _ = tx.send(evaluate(st, &t2, op));
    }));
    rx
}

/// The tensors of `tensors`, grouped by worker, in first-seen order.
fn by_worker(tensors: Vec<TensorArg>) -> Vec<(Arc<Worker>, Vec<TensorArg>)> {
    let mut groups: Vec<(Arc<Worker>, Vec<TensorArg>)> = Vec::new();
    for t in tensors {
        match groups.iter_mut().find(|(w, _)| Arc::ptr_eq(w, &t.worker)) {
            Some((_, g)) => g.push(t),
            None => groups.push((t.worker.clone(), vec![t])),
        }
    }
    groups
}

/// Evaluates `tensors` (all of this worker) in one graph evaluation, then records each
/// one's evaluated array in turn: one that came out strided (a loaded weight's
/// transpose, say) is copied row-contiguous as it is recorded, and the view it replaces
/// let go before the next copy, so a model's transposed weights never exist twice at
/// once (and each copy can take the memory the one before freed).
fn eval_group(st: &mut State, tensors: &[TensorArg]) -> Result<(), Error> {
    let pending: Vec<&TensorArg> = tensors.iter().filter(|t| t.evaluated().is_none()).collect();
    if pending.is_empty() {
        return Ok(());
    }
    {
        let arrays = pending.iter().map(|t| st.arrays.get(t.id, "eval")).collect::<Result<Vec<_>, _>>()?;
        let v = crate::bridge::array_vec(arrays.into_iter());
        ffi::eval_arrays(&v).map_err(|e| Error::Mlx {
            op: "eval".into(),
            message: e.what().into(),
            inputs: format!("{} tensors", pending.len()),
        })?;
    }
    for t in pending {
        evaluate(st, t, "eval")?;
    }
    Ok(())
}

/// The reply of a call that waits on several workers: sent once the last one is done.
struct Gather {
    reply: Mutex<Option<Reply>>,
    remaining: AtomicUsize,
    error: Mutex<Option<Error>>,
}

impl Gather {
    fn done(&self, res: Result<(), Error>) {
        if let Err(e) = res {
            self.error.lock().unwrap().get_or_insert(e);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let err = self.error.lock().unwrap().take();
            if let Some(reply) = self.reply.lock().unwrap().take() {
                reply.send_result(match err {
                    None => Ok(crate::atoms::ok()),
                    Some(e) => Err(e),
                });
            }
        }
    }
}

/// `eval(ref, tensors)`: evaluates each tensor on its own worker (one graph evaluation per
/// worker, the workers in parallel); replies `{ref, {:ok, :ok}}` once all are done, or
/// `{ref, {:error, e}}` with an error.
#[rustler::nif]
fn eval<'a>(env: Env<'a>, reference: Term<'a>, tensors: List<Live<TensorArg>>) -> NifResult<Term<'a>> {
    let tensors = List(tensors.0.into_iter().map(|t| t.0).collect::<Vec<_>>());
    // Evaluated tensors need no worker: neither does a call with nothing else to wait on.
    let mut groups = by_worker(tensors.0.into_iter().filter(|t| t.evaluated().is_none()).collect());
    if groups.is_empty() {
        return Ok(reply_now(env, reference, (crate::atoms::ok(), crate::atoms::ok()).encode(env)));
    }
    let reply = Reply::new(env, reference);
    if groups.len() == 1 {
        // The common case, one worker: it replies itself.
        let (worker, group) = groups.pop().expect("one group");
        worker.submit(Box::new(move |st: &mut State| {
            reply.send_result(eval_group(st, &group).map(|()| crate::atoms::ok()))
        }));
        return Ok(reference);
    }
    let gather = Arc::new(Gather {
        reply: Mutex::new(Some(reply)),
        remaining: AtomicUsize::new(groups.len()),
        error: Mutex::new(None),
    });
    for (worker, group) in groups {
        let gather = gather.clone();
        worker.submit(Box::new(move |st: &mut State| gather.done(eval_group(st, &group))));
    }
    Ok(reference)
}

/// `async_eval(tensors)`: starts evaluating each tensor on its own worker and returns at
/// once. The worker goes on with later jobs while MLX computes; a later waiting call
/// (`eval`, `to_binary`) finds the values ready or waits for them, and reports errors.
#[rustler::nif]
fn async_eval(tensors: List<Live<TensorArg>>) -> rustler::Atom {
    for (worker, group) in by_worker(tensors.0.into_iter().map(|t| t.0).collect()) {
        worker.submit(Box::new(move |st: &mut State| {
            let mut v = ffi::array_vec_new(group.len());
            for t in group.iter().filter(|t| t.evaluated().is_none()) {
                // A failed input reports its error at the next waiting call.
                if let Ok(a) = st.arrays.get(t.id, "async_eval") {
                    ffi::array_vec_push(v.pin_mut(), a);
                }
            }
            if ffi::array_vec_len(&v) > 0 {
                // Errors stay with the arrays and surface when they are waited for.
                let _ = ffi::async_eval_arrays(&v);
            }
        }));
    }
    crate::atoms::ok()
}

/// `to_binary(ref, tensor)`: the evaluated, row-contiguous array's bytes as a zero-copy
/// binary. An evaluated tensor's come back at once, as `{:ok, binary}`; otherwise the
/// call returns `ref` and the worker replies `{ref, {:ok, binary}}` once it has them.
#[rustler::nif]
fn to_binary<'a>(env: Env<'a>, reference: Term<'a>, tensor: Live<TensorArg>) -> Term<'a> {
    let Live(tensor) = tensor;
    if let Some(arr) = tensor.evaluated() {
        return (crate::atoms::ok(), export_binary(env, arr, &tensor.worker)).encode(env);
    }
    let reply = Reply::new(env, reference);
    let worker = tensor.worker.clone();
    worker.submit(Box::new(move |st: &mut State| match evaluate(st, &tensor, "to_binary") {
        Err(e) => reply.send_result::<()>(Err(e)),
        Ok(arr) => {
            reply.send(|env| (crate::atoms::ok(), export_binary(env, arr, &tensor.worker)).encode(env))
        }
    }));
    reference
}

/// A binary over `arr`'s bytes (evaluated arrays are row-contiguous), which keeps `arr`
/// alive; `worker` frees it once the binary is garbage.
fn export_binary<'a>(env: Env<'a>, arr: Arc<SendArray>, worker: &Arc<Worker>) -> Term<'a> {
    let len = ffi::array_nbytes(&arr.0);
    let ptr = ffi::array_data(&arr.0);
    let res = ResourceArc::new(ExportResource { array: Some(arr), worker: worker.clone() });
    // SAFETY: the resource keeps the evaluated buffer alive and unchanged for as long as
    // the binary exists.
    let bytes: &[u8] = if len == 0 { &[] } else { unsafe { std::slice::from_raw_parts(ptr, len) } };
    res.make_binary(env, |_| bytes).encode(env)
}

/// `describe(ref, tensor)`: replies `{ref, {:ok, {shape_tuple, dtype}}}` without evaluating.
#[rustler::nif]
fn describe<'a>(env: Env<'a>, reference: Term<'a>, tensor: Live<TensorArg>) -> Term<'a> {
    let Live(tensor) = tensor;
    if let Some(a) = tensor.evaluated() {
        let shape = described(env, ffi::array_shape(&a.0), ffi::array_dtype_val(&a.0));
        return reply_now(env, reference, (crate::atoms::ok(), shape).encode(env));
    }
    let reply = Reply::new(env, reference);
    let worker = tensor.worker.clone();
    worker.submit(Box::new(move |st: &mut State| {
        let res =
            st.arrays.get(tensor.id, "describe").map(|a| (ffi::array_shape(a), ffi::array_dtype_val(a)));
        reply.send(|env| match res {
            Ok((shape, val)) => (crate::atoms::ok(), described(env, shape, val)).encode(env),
            Err(e) => (crate::atoms::error(), e.to_exception()).encode(env),
        });
    }));
    reference
}

/// `{shape_tuple, dtype}`.
fn described(env: Env, shape: Vec<i32>, dtype_val: u8) -> Term {
    let dims: Vec<Term> = shape.iter().map(|d| d.encode(env)).collect();
    let dtype = DType::from_val(dtype_val).expect("MLX dtype");
    (rustler::types::tuple::make_tuple(env, &dims), dtype).encode(env)
}

/// Replies `{reference, result}` from the calling NIF itself, for a waiting call whose
/// answer needs no worker. (OwnedEnv cannot send from a scheduler thread: the message
/// goes through the caller's env.)
fn reply_now<'a>(env: Env<'a>, reference: Term<'a>, result: Term<'a>) -> Term<'a> {
    let _ = env.send(&env.pid(), (reference, result).encode(env));
    reference
}

/// Whether `tensor` belongs to `stream`'s worker (false once the stream is released).
#[rustler::nif]
fn tensor_on_stream(tensor: TensorArg, stream: StreamArg) -> bool {
    stream.get().is_some_and(|w| Arc::ptr_eq(&tensor.worker, &w))
}

/// `tensor_evaluated(tensor)`: whether an evaluated copy of `tensor` is held, so that any
/// stream can read it without waiting on its own.
#[rustler::nif]
fn tensor_evaluated(tensor: TensorArg) -> bool {
    tensor.evaluated().is_some()
}

/// `tensor_release(tensor)`: frees `tensor`'s array now instead of when the BEAM collects
/// the handle (MLX can then reuse its buffer at once). Returns `:ok`, or
/// `:already_released`. Later uses of the handle fail with `Emily.Error`; other tensors
/// computed from it are unaffected.
#[rustler::nif]
fn tensor_release(tensor: Live<TensorArg>) -> rustler::Atom {
    if tensor.0.release() {
        crate::atoms::ok()
    } else {
        crate::atoms::already_released()
    }
}
