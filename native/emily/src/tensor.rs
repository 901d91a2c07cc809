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
use crate::term::Shape;
use crate::worker::{next_id, State, Worker};
use rustler::env::SavedTerm;
use rustler::{Binary, Encoder, Env, LocalPid, NifResult, OwnedEnv, Resource, ResourceArc, Term};
use std::sync::{Arc, OnceLock};

pub struct TensorResource {
    pub id: u64,
    pub worker: Arc<Worker>,
    /// The evaluated array, once some eval/to_binary has produced it.
    pub evaluated: OnceLock<Arc<SendArray>>,
}

#[rustler::resource_impl]
impl Resource for TensorResource {}

pub type TensorArg = ResourceArc<TensorResource>;

impl TensorResource {
    pub fn new(worker: &Arc<Worker>) -> TensorArg {
        ResourceArc::new(TensorResource { id: next_id(), worker: worker.clone(), evaluated: OnceLock::new() })
    }
}

impl Drop for TensorResource {
    fn drop(&mut self) {
        // Arrays are only ever destroyed on a worker thread.
        let id = self.id;
        let evaluated = self.evaluated.take();
        self.worker.submit(Box::new(move |st: &mut State| {
            st.arrays.remove(&id);
            drop(evaluated);
        }));
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
        self.worker.submit(Box::new(move |_| drop(a)));
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
fn evaluate(st: &mut State, t: &TensorArg, op: &str) -> Result<Arc<SendArray>, Error> {
    if let Some(a) = t.evaluated.get() {
        return Ok(a.clone());
    }
    let arr = st.get(t.id, op)?;
    let res = ffi::export_array(arr, &st.stream).map_err(|e| mlx_error(op, e, &[arr]))?;
    let shared = Arc::new(SendArray(res));
    // The worker's own slot now holds the evaluated array too, so later ops on it start
    // from data rather than from the graph.
    st.put(t.id, Ok(ffi::clone_array(&shared.0)));
    Ok(t.evaluated.get_or_init(|| shared).clone())
}

pub fn mlx_error(op: &str, e: cxx::Exception, inputs: &[&ffi::Array]) -> Error {
    let described: Vec<(Vec<i32>, String)> = inputs
        .iter()
        .map(|a| {
            let dt = DType::from_val(ffi::array_dtype_val(a))
                .map(|d| d.short_name())
                .unwrap_or_else(|| "?".into());
            (ffi::array_shape(a), dt)
        })
        .collect();
    Error::Mlx { op: op.into(), message: e.what().to_string(), inputs: crate::error::describe(&described) }
}

/// `from_binary(stream, binary, shape, dtype)`: one copy into a new MLX array.
#[rustler::nif]
fn from_binary<'a>(stream: StreamArg, data: Term<'a>, shape: Shape, dtype: DType) -> NifResult<TensorArg> {
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
    let out = TensorResource::new(&stream.worker);
    let id = out.id;
    // Keep the binary alive by reference (no copy) until the worker has read it.
    let owned = OwnedEnv::new();
    let saved = owned.save(data);
    let dims: Vec<i32> = shape.0.iter().map(|&d| d as i32).collect();
    stream.worker.submit(Box::new(move |st: &mut State| {
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
        st.put(id, value);
    }));
    Ok(out)
}

/// `eval(ref, tensors)`: evaluates each tensor on its own worker; replies `{ref, :ok}`
/// once all are done, or `{ref, {:error, e}}` with the first error.
#[rustler::nif]
fn eval<'a>(env: Env<'a>, reference: Term<'a>, tensors: Vec<TensorArg>) -> NifResult<Term<'a>> {
    let Some(first) = tensors.first() else {
        let msg = (reference, (crate::atoms::ok(), crate::atoms::ok())).encode(env);
        let _ = env.send(&env.pid(), msg);
        return Ok(reference);
    };
    let reply = Reply::new(env, reference);
    let worker = first.worker.clone();
    if tensors.iter().any(|t| !Arc::ptr_eq(&t.worker, &worker)) {
        return Err(argument_error("eval: all tensors must belong to one stream"));
    }
    worker.submit_now(Box::new(move |st: &mut State| {
        let pending: Vec<&TensorArg> = tensors.iter().filter(|t| t.evaluated.get().is_none()).collect();
        // One graph eval for all of them, then record each evaluated array.
        let res = (|| -> Result<(), Error> {
            let mut v = ffi::array_vec_new();
            for t in &pending {
                ffi::array_vec_push(v.pin_mut(), st.get(t.id, "eval")?);
            }
            ffi::eval_arrays(&v).map_err(|e| Error::Mlx {
                op: "eval".into(),
                message: e.what().into(),
                inputs: format!("{} tensors", pending.len()),
            })?;
            for t in &pending {
                evaluate(st, t, "eval")?;
            }
            Ok(())
        })();
        reply.send_result(res.map(|_| crate::atoms::ok()));
    }));
    Ok(reference)
}

/// `to_binary(ref, tensor)`: replies `{ref, {:ok, binary}}`, the binary a zero-copy view of
/// the evaluated, row-contiguous array.
#[rustler::nif]
fn to_binary<'a>(env: Env<'a>, reference: Term<'a>, tensor: TensorArg) -> Term<'a> {
    let reply = Reply::new(env, reference);
    let worker = tensor.worker.clone();
    worker.submit_now(Box::new(move |st: &mut State| match evaluate(st, &tensor, "to_binary") {
        Err(e) => reply.send_result::<()>(Err(e)),
        Ok(arr) => {
            let len = ffi::array_nbytes(&arr.0);
            let ptr = ffi::array_data(&arr.0);
            let res = ResourceArc::new(ExportResource { array: Some(arr), worker: tensor.worker.clone() });
            reply.send(|env| {
                // SAFETY: the resource keeps the evaluated buffer alive and unchanged for as
                // long as the binary exists.
                let bytes: &[u8] =
                    if len == 0 { &[] } else { unsafe { std::slice::from_raw_parts(ptr, len) } };
                let bin = res.make_binary(env, |_| bytes);
                (crate::atoms::ok(), bin).encode(env)
            });
        }
    }));
    reference
}

/// `describe(ref, tensor)`: replies `{ref, {:ok, {shape_tuple, dtype}}}` without evaluating.
#[rustler::nif]
fn describe<'a>(env: Env<'a>, reference: Term<'a>, tensor: TensorArg) -> Term<'a> {
    let reply = Reply::new(env, reference);
    let worker = tensor.worker.clone();
    worker.submit_now(Box::new(move |st: &mut State| {
        let res = st.get(tensor.id, "describe").map(|a| (ffi::array_shape(a), ffi::array_dtype_val(a)));
        reply.send(|env| match res {
            Ok((shape, val)) => {
                let dims: Vec<Term> = shape.iter().map(|d| d.encode(env)).collect();
                let dtype = DType::from_val(val).expect("MLX dtype");
                (crate::atoms::ok(), (rustler::types::tuple::make_tuple(env, &dims), dtype)).encode(env)
            }
            Err(e) => (crate::atoms::error(), e.to_exception()).encode(env),
        });
    }));
    reference
}

/// Whether `tensor` belongs to `stream`'s worker.
#[rustler::nif]
fn tensor_on_stream(tensor: TensorArg, stream: StreamArg) -> bool {
    Arc::ptr_eq(&tensor.worker, &stream.worker)
}
