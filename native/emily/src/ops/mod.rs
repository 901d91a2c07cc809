//! Op families. Each `ops/<family>.rs` includes the NIFs generated from
//! `optable/<family>.ops` and holds whatever that family needs by hand.
//!
//! A generated NIF fills a `Call` with its arguments and submits it: the outputs come back
//! at once as tensor handles, and the worker builds the MLX node in order behind them.
use crate::bridge::{ffi, SendArray};
use crate::dtype::DType;
use crate::error::{argument_error, Error};
use crate::stream::StreamArg;
use crate::tensor::{mlx_error, TensorArg, TensorResource};
use crate::worker::{State, Worker};
use rustler::NifResult;
use std::sync::Arc;

pub mod binary;
pub mod conv;
pub mod creation;
pub mod fast;
pub mod fft;
pub mod index;
pub mod linalg;
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

enum Input {
    /// A tensor held by the call's own worker.
    Local(u64),
    /// An evaluated tensor of another worker.
    Shared(Arc<SendArray>),
}

pub struct Call {
    worker: Arc<Worker>,
    op: u32,
    name: &'static str,
    outputs: usize,
    inputs: Vec<Input>,
    ints: Vec<i64>,
    floats: Vec<f64>,
    strs: Vec<String>,
}

impl Call {
    pub fn new(stream: &StreamArg, op: u32, name: &'static str, outputs: usize) -> Call {
        Call {
            worker: stream.worker.clone(),
            op,
            name,
            outputs,
            inputs: Vec::new(),
            ints: Vec::new(),
            floats: Vec::new(),
            strs: Vec::new(),
        }
    }

    pub fn tensor(&mut self, t: &TensorArg) -> NifResult<()> {
        let input = if Arc::ptr_eq(&t.worker, &self.worker) {
            Input::Local(t.id)
        } else if let Some(a) = t.evaluated.get() {
            Input::Shared(a.clone())
        } else {
            return Err(argument_error(format!(
                "{}: an input tensor is lazy on another stream ({}); evaluate it first",
                self.name, t.worker.name
            )));
        };
        self.inputs.push(input);
        Ok(())
    }

    pub fn opt_tensor(&mut self, t: &Option<TensorArg>) -> NifResult<()> {
        self.ints.push(t.is_some() as i64);
        match t {
            Some(t) => self.tensor(t),
            None => Ok(()),
        }
    }

    pub fn tensors(&mut self, ts: &[TensorArg]) -> NifResult<()> {
        self.ints.push(ts.len() as i64);
        ts.iter().try_for_each(|t| self.tensor(t))
    }

    pub fn int(&mut self, i: i64) {
        self.ints.push(i);
    }

    pub fn ints(&mut self, v: &[i64]) {
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

    pub fn submit_one(self) -> NifResult<TensorArg> {
        Ok(self.submit().pop().expect("one output"))
    }

    pub fn submit_many(self) -> NifResult<Vec<TensorArg>> {
        Ok(self.submit())
    }

    fn submit(self) -> Vec<TensorArg> {
        let outs: Vec<TensorArg> = (0..self.outputs).map(|_| TensorResource::new(&self.worker)).collect();
        let ids: Vec<u64> = outs.iter().map(|t| t.id).collect();
        let worker = self.worker.clone();
        worker.submit(Box::new(move |st: &mut State| match self.run(st) {
            Ok(mut v) => {
                for (i, id) in ids.into_iter().enumerate() {
                    let a = ffi::array_vec_take(v.pin_mut(), i).expect("output count checked");
                    st.put(id, Ok(a));
                }
            }
            Err(e) => {
                let e = Arc::new(e);
                for id in ids {
                    st.put(id, Err(e.clone()));
                }
            }
        }));
        outs
    }

    fn run(&self, st: &State) -> Result<cxx::UniquePtr<ffi::ArrayVec>, Error> {
        let mut v = ffi::array_vec_new();
        let mut refs: Vec<&ffi::Array> = Vec::with_capacity(self.inputs.len());
        for input in &self.inputs {
            let a = match input {
                Input::Local(id) => st.get(*id, self.name)?,
                Input::Shared(a) => &a.0,
            };
            ffi::array_vec_push(v.pin_mut(), a);
            refs.push(a);
        }
        let out = ffi::op_call(self.op, &v, &self.ints, &self.floats, &self.strs, &st.stream)
            .map_err(|e| mlx_error(self.name, e, &refs))?;
        let n = ffi::array_vec_len(&out);
        if n != self.outputs {
            return Err(Error::Mlx {
                op: self.name.into(),
                message: format!("returned {n} arrays, the op table says {}", self.outputs),
                inputs: String::new(),
            });
        }
        Ok(out)
    }
}
