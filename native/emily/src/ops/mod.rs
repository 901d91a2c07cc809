//! Op families. Each `ops/<family>.rs` includes the NIFs generated from
//! `optable/<family>.ops` and holds whatever that family needs by hand.
//!
//! A generated NIF fills a `Call` with its arguments and submits it: the outputs come back
//! at once as tensor handles, and the worker builds the MLX node in order behind them.
use crate::bridge::{ffi, SendArray};
use crate::dtype::DType;
use crate::error::{argument_error, Error};
use crate::stream::StreamArg;
use crate::tensor::{mlx_error, request_export, TensorArg, TensorResource};
use crate::worker::{Arrays, State, Worker};
use rustler::NifResult;
use smallvec::SmallVec;
use std::ops::Range;
use std::pin::Pin;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

pub mod binary;
pub mod conv;
pub mod creation;
pub mod debug;
pub mod distributed;
pub mod fast;
pub mod fft;
pub mod index;
pub mod linalg;
pub mod memory;
pub mod program;
pub mod quant;
pub mod random;
pub mod reduce;
pub mod scan;
pub mod shape;
pub mod sort;
pub mod types;
pub mod unary;
pub mod window;

/// The output count of a row whose count comes from an argument (`-> name` in the table).
pub fn output_count(name: &str, n: i64) -> NifResult<usize> {
    // A bound keeps a bad argument from allocating handles without end.
    if (1..=65536).contains(&n) {
        Ok(n as usize)
    } else {
        Err(argument_error(format!("{name}: expected 1 to 65536 outputs, got {n}")))
    }
}

/// A tensor input of a job, from the NIF (scheduler side) to the worker.
pub(crate) enum Input {
    /// A tensor in the job's own worker's map (lazy, or evaluated there).
    Local(u64),
    /// An evaluated tensor, of any worker.
    Shared(Arc<SendArray>),
    /// A lazy tensor of another worker, not yet asked for (see `Inputs::request`).
    Foreign(TensorArg),
    /// The one-shot an export job on the tensor's own worker fills.
    Awaiting(Receiver<Result<Arc<SendArray>, Error>>),
}

/// The tensor inputs of one job, in order.
#[derive(Default)]
pub(crate) struct Inputs(SmallVec<[Input; 3]>);

impl Inputs {
    /// Adds `t` as seen from a job of `worker` (`None`: a released stream, whose job is
    /// refused before anything is queued).
    /// A tensor of the job's own worker is passed by id, evaluated or not: the common case
    /// touches no lock and no reference count that the worker touches too. Any other
    /// evaluated tensor is passed by its evaluated array, including one of the same worker
    /// evaluated outside it (`program_eval`), which is not in the worker's map.
    pub fn push(&mut self, t: &TensorArg, worker: Option<&Arc<Worker>>) {
        let local = worker.is_some_and(|w| Arc::ptr_eq(&t.worker, w));
        let input = if local && t.held {
            Input::Local(t.id)
        } else if let Some(a) = t.evaluated() {
            Input::Shared(a)
        } else if local {
            Input::Local(t.id)
        } else {
            Input::Foreign(t.clone())
        };
        self.0.push(input);
    }

    /// Queues an export for every lazy foreign input. Call it on the scheduler, right
    /// before queueing the job that uses the inputs: each export is then queued before
    /// the job that waits on it, which is what rules out deadlocks (`worker.rs`).
    pub fn request(&mut self, op: &'static str) {
        for input in &mut self.0 {
            if let Input::Foreign(t) = input {
                *input = Input::Awaiting(request_export(t, op));
            }
        }
    }

    /// On the worker: waits for the exports, then lists the arrays in order.
    pub fn resolve<'s>(
        &'s mut self,
        arrays: &'s Arrays,
        op: &str,
    ) -> Result<SmallVec<[&'s ffi::Array; 4]>, Error> {
        for input in &mut self.0 {
            if let Input::Awaiting(rx) = input {
                let a = rx.recv().unwrap_or_else(|_| {
                    Err(Error::Mlx {
                        op: op.into(),
                        message: "the stream of an input stopped before evaluating it".into(),
                        inputs: String::new(),
                    })
                })?;
                *input = Input::Shared(a);
            }
        }
        self.0
            .iter()
            .map(|input| match input {
                Input::Local(id) => arrays.get(*id, op),
                Input::Shared(a) => Ok(&*a.0),
                Input::Foreign(_) | Input::Awaiting(_) => unreachable!("requested and resolved above"),
            })
            .collect()
    }
}

/// The scalar arguments of an op, in the order the generated C++ `Reader` reads them.
#[derive(Default, Clone)]
pub struct Args {
    pub ints: SmallVec<[i64; 8]>,
    pub floats: SmallVec<[f64; 2]>,
    pub strs: Vec<String>,
    /// Why an argument was refused (reported when the op is submitted).
    pub bad: Option<String>,
}

impl Args {
    pub fn int(&mut self, i: i64) {
        self.ints.push(i);
    }

    /// An `int` argument: the C++ side takes it as a 32-bit int, so a value outside that
    /// range is refused rather than silently wrapped (`int64` arguments use `int`).
    pub fn int32(&mut self, name: &str, i: i64) {
        if i32::try_from(i).is_err() {
            self.bad.get_or_insert_with(|| format!("{name} {i} does not fit in 32 bits"));
        }
        self.ints.push(i);
    }

    /// An `ints` argument: MLX takes these as 32-bit ints (axes, starts, strides), so a
    /// value outside that range is refused rather than silently wrapped.
    pub fn ints(&mut self, v: &[i64]) {
        if let Some(x) = v.iter().find(|&&x| i32::try_from(x).is_err()) {
            self.bad.get_or_insert_with(|| format!("{x} in {v:?} does not fit in 32 bits"));
        }
        self.ints.push(v.len() as i64);
        self.ints.extend_from_slice(v);
    }

    pub fn float(&mut self, f: f64) {
        self.floats.push(f);
    }

    pub fn dtype(&mut self, d: DType) {
        self.ints.push(d.val as i64);
        self.ints.push(d.size as i64);
    }

    pub fn str(&mut self, s: String) {
        self.strs.push(s);
    }
}

/// The share of a scheduler timeslice (about 1 ms) charged per op NIF call.
pub const OP_TIMESLICE_PERCENT: i32 = 2;

pub struct Call {
    /// Taken by `submit`, so that the queued job does not hold its own worker.
    worker: Option<Arc<Worker>>,
    op: u32,
    name: &'static str,
    outputs: usize,
    inputs: Inputs,
    /// The scalar arguments; generated NIFs push to it directly.
    pub args: Args,
}

impl Call {
    /// A call of `op` on `stream`; an `ArgumentError` if the stream was released.
    pub fn new(
        env: rustler::Env,
        stream: &StreamArg,
        op: u32,
        name: &'static str,
        outputs: usize,
    ) -> NifResult<Call> {
        // Queueing an op costs microseconds, but a process that queues many in a row
        // would otherwise hold its scheduler for as long as it likes: charging each call
        // a share of the timeslice makes it yield like Erlang code does.
        rustler::schedule::consume_timeslice(env, OP_TIMESLICE_PERCENT);
        Ok(Call {
            worker: Some(stream.worker(name)?),
            op,
            name,
            outputs,
            inputs: Inputs::default(),
            args: Args::default(),
        })
    }

    pub fn tensor(&mut self, t: &TensorArg) -> NifResult<()> {
        self.inputs.push(t, self.worker.as_ref());
        Ok(())
    }

    pub fn opt_tensor(&mut self, t: &Option<TensorArg>) -> NifResult<()> {
        self.args.int(t.is_some() as i64);
        match t {
            Some(t) => self.tensor(t),
            None => Ok(()),
        }
    }

    pub fn tensors(&mut self, ts: &[TensorArg]) -> NifResult<()> {
        self.args.int(ts.len() as i64);
        ts.iter().try_for_each(|t| self.tensor(t))
    }

    pub fn submit_one(self) -> NifResult<TensorArg> {
        Ok(self.submit()?.pop().expect("one output"))
    }

    pub fn submit_many(self) -> NifResult<Vec<TensorArg>> {
        self.submit()
    }

    fn submit(mut self) -> NifResult<Vec<TensorArg>> {
        if let Some(bad) = &self.args.bad {
            return Err(crate::error::argument_error(format!("{}: {bad}", self.name)));
        }
        let worker = self.worker.take().expect("a call is submitted once");
        let (outs, ids) = TensorResource::outputs(&worker, self.outputs);
        self.inputs.request(self.name);
        worker.submit_lazy(Box::new(move |st: &mut State| {
            let res = self.run(st);
            let State { arrays, op_results, .. } = st;
            put_outputs(arrays, ids, res.map(|()| op_results.pin_mut()));
            ffi::array_vec_clear(op_results.pin_mut());
        }));
        Ok(outs)
    }

    /// Builds the op's node into the worker's `op_results`.
    fn run(&mut self, st: &mut State) -> Result<(), Error> {
        let refs = self.inputs.resolve(&st.arrays, self.name)?;
        for a in &refs {
            ffi::array_vec_push(st.op_args.pin_mut(), a);
        }
        let a = &self.args;
        let res = ffi::op_call(
            self.op,
            &st.op_args,
            &a.ints,
            &a.floats,
            &a.strs,
            &st.stream,
            st.op_results.pin_mut(),
        );
        // The arguments are not kept: holding them would keep their arrays alive (and
        // their buffers from being donated) until the next op.
        ffi::array_vec_clear(st.op_args.pin_mut());
        res.map_err(|e| mlx_error(self.name, e, &refs))?;
        check_outputs(self.name, &st.op_results, self.outputs)
    }
}

/// Checks that an op returned as many arrays as its table row says.
pub(crate) fn check_outputs(op: &str, out: &ffi::ArrayVec, expected: usize) -> Result<(), Error> {
    let n = ffi::array_vec_len(out);
    if n != expected {
        return Err(Error::Mlx {
            op: op.into(),
            message: format!("returned {n} arrays, the op table says {expected}"),
            inputs: String::new(),
        });
    }
    Ok(())
}

/// Stores a job's outputs (or its error, in every output) under `ids`, taking them out
/// of `res`.
pub(crate) fn put_outputs(arrays: &mut Arrays, ids: Range<u64>, res: Result<Pin<&mut ffi::ArrayVec>, Error>) {
    match res {
        Ok(mut v) => {
            for (i, id) in ids.enumerate() {
                let a = ffi::array_vec_take(v.as_mut(), i).expect("output count checked");
                arrays.put(id, Ok(a));
            }
        }
        Err(e) => {
            let e = Arc::new(e);
            for id in ids {
                arrays.put(id, Err(e.clone()));
            }
        }
    }
}
