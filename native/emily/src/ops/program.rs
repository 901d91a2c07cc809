//! Programs: a list of op-table ops replayed in one native call on one worker, optionally
//! compiled with `mx::compile` (`optable/program.ops`; `Emily.Program` documents the
//! format).
//!
//! An instruction is `{op_name, args}`: `args` are the op's `Emily.Native` arguments after
//! the stream, with a slot index in place of each tensor (a list of slots for `tensors`,
//! `nil` or a slot for `tensor?`). Slots `0..n_inputs` are the program's inputs; each
//! instruction appends its outputs. Each op decodes its args with the decoder generated
//! from its table row (build/codegen.rs), so programs and NIFs cannot disagree.
//!
//! A compiled program has one compiled form per device (`Compiled`), shared by every
//! thread that runs it: MLX's compile cache is thread-local, so each thread (a stream's
//! worker, or the scheduler of a `program_eval`) holds its own entry, and the form erases
//! all of them when the program is garbage.
use crate::bridge::ffi;
use crate::bridge::SendArray;
use crate::error::{argument_error, Error};
use crate::ops::{check_outputs, put_outputs, Args, Inputs};
use crate::stream::{released_error, StreamArg};
use crate::tensor::{mlx_error, Reply, TensorArg, TensorResource};
use crate::term::{short, List, Live};
use crate::worker::{next_id, Busy, Device, State, Worker};
use rustler::{Decoder, Encoder, Env, NifResult, Resource, ResourceArc, Term};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

include!(concat!(env!("OUT_DIR"), "/program_table.rs"));

/// One op of the table, as programs see it.
pub struct OpEntry {
    pub id: u32,
    pub name: &'static str,
    pub outputs: usize,
    pub decode: for<'a> fn(&mut Instr, &[Term<'a>]) -> NifResult<()>,
}

fn lookup(name: &str) -> Option<&'static OpEntry> {
    FAMILIES.iter().flat_map(|f| f.iter()).find(|e| e.name == name)
}

/// An instruction being decoded: its input slots and scalar args.
pub struct Instr {
    name: &'static str,
    index: usize,
    /// Slots filled so far (inputs plus earlier outputs): every slot must be below it.
    available: usize,
    slots: Vec<u32>,
    /// The scalar arguments; generated decoders push to it directly.
    pub args: Args,
}

impl Instr {
    fn err(&self, what: String) -> rustler::Error {
        argument_error(format!("program: instruction {} ({}): {what}", self.index, self.name))
    }

    pub fn arity(&self, args: &[Term], n: usize) -> NifResult<()> {
        if args.len() != n {
            return Err(self.err(format!("expected {n} arguments, got {}", args.len())));
        }
        Ok(())
    }

    /// Decodes argument `name` as its table type; a bad term is an `ArgumentError` naming
    /// the instruction and the argument.
    pub fn decode<'a, T: Decoder<'a>>(&self, term: Term<'a>, name: &str) -> NifResult<T> {
        term.decode::<T>().map_err(|_| self.err(format!("bad argument `{name}`: {}", short(term))))
    }

    fn slot(&self, term: Term) -> NifResult<u32> {
        match term.decode::<u32>() {
            Ok(i) if (i as usize) < self.available => Ok(i),
            _ => Err(self.err(format!(
                "a tensor argument must be a slot index below {}, got {}",
                self.available,
                short(term)
            ))),
        }
    }

    pub fn tensor(&mut self, term: Term) -> NifResult<()> {
        let i = self.slot(term)?;
        self.slots.push(i);
        Ok(())
    }

    pub fn opt_tensor(&mut self, term: Term) -> NifResult<()> {
        if term.is_atom() && term.decode::<rustler::Atom>().is_ok_and(|a| a == rustler::types::atom::nil()) {
            self.args.int(0);
            return Ok(());
        }
        self.args.int(1);
        self.tensor(term)
    }

    pub fn tensors(&mut self, term: Term) -> NifResult<()> {
        let list: Vec<Term> =
            term.decode().map_err(|_| self.err(format!("expected a list of slots, got {term:?}")))?;
        self.args.int(list.len() as i64);
        list.into_iter().try_for_each(|t| self.tensor(t))
    }
}

/// The C++ program, immutable once built.
struct Spec(cxx::UniquePtr<ffi::ProgramSpec>);
// SAFETY: built once on a scheduler, then only read (program_call takes it by const&);
// its tapes, which runs add, are behind a mutex (cpp/tape.h).
unsafe impl Send for Spec {}
unsafe impl Sync for Spec {}

/// The program compiled with `mx::compile`, for every thread that runs it (cpp/program.h).
struct Compiled(cxx::UniquePtr<ffi::Compiled>);
// SAFETY: built once, then only called: each call goes through the calling thread's own
// MLX compile cache (thread-local), and the list of caches it erases when dropped is
// behind its mutex; MLX's erase is thread-safe.
unsafe impl Send for Compiled {}
unsafe impl Sync for Compiled {}

pub struct ProgramResource {
    id: u64,
    n_inputs: usize,
    n_instrs: usize,
    outputs: usize,
    compile: bool,
    spec: Spec,
    /// Its compiled form, by device (made at its first run there).
    compiled: [Mutex<Option<Arc<Compiled>>>; 2],
    /// What its runs have learned of it, by the signature of its inputs' shapes and
    /// dtypes (see `Fit`).
    fits: Mutex<HashMap<u64, Fit>>,
}

#[rustler::resource_impl]
impl Resource for ProgramResource {}

/// Program ids live in their own range, far from the function addresses MLX uses as
/// compile-cache keys for its own compiled functions (a program's compiled form adds
/// 2^60 times one more than its device to its id).
const PROGRAM_ID_BASE: u64 = 1 << 62;

/// `program_new(n_inputs, instrs, outputs, compile)`: checks and decodes a program.
/// Malformed programs (unknown ops, bad arity or argument terms, slots that are not yet
/// filled) raise `ArgumentError` here; shape and dtype errors come from MLX when it runs.
#[rustler::nif]
fn program_new<'a>(
    n_inputs: i64,
    instrs: List<Term<'a>>,
    outputs: List<i64>,
    compile: bool,
) -> NifResult<ResourceArc<ProgramResource>> {
    let (instrs, outputs) = (instrs.0, outputs.0);
    let n_inputs = usize::try_from(n_inputs)
        .ok()
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or_else(|| argument_error(format!("program: bad input count {n_inputs}")))?;
    let mut spec = ffi::program_spec_new(n_inputs);
    let mut available = n_inputs;
    for (index, term) in instrs.iter().enumerate() {
        let bad = || {
            argument_error(format!("program: instruction {index} must be {{op_name, [args]}}, got {term:?}"))
        };
        let tuple = rustler::types::tuple::get_tuple(*term).map_err(|_| bad())?;
        let [op, args] = tuple[..] else { return Err(bad()) };
        let name = op.atom_to_string().map_err(|_| bad())?;
        let entry = lookup(&name).ok_or_else(|| {
            argument_error(format!("program: instruction {index}: `{name}` is not an op of the op table"))
        })?;
        let args: List<Term> = args.decode().map_err(|_| bad())?;
        let args = args.0;
        if entry.outputs == 0 {
            // `-> arg` rows (split, meshgrid): the count depends on the call's arguments.
            return Err(argument_error(format!(
                "program: instruction {index} ({}) has a variable output count; programs take fixed-output ops",
                entry.name
            )));
        }
        let mut instr =
            Instr { name: entry.name, index, available, slots: Vec::new(), args: Args::default() };
        (entry.decode)(&mut instr, &args)?;
        if let Some(bad) = &instr.args.bad {
            return Err(instr.err(bad.clone()));
        }
        let slots = instr.slots;
        let a = instr.args;
        ffi::program_spec_push(
            spec.pin_mut(),
            entry.id,
            entry.name,
            &slots,
            &a.ints,
            &a.floats,
            &a.strs,
            entry.outputs as u32,
        );
        available += entry.outputs;
    }
    if available > u32::MAX as usize {
        return Err(argument_error("program: too many slots"));
    }
    let outs: Vec<u32> = outputs
        .iter()
        .map(|&o| {
            u32::try_from(o).ok().filter(|&o| (o as usize) < available).ok_or_else(|| {
                argument_error(format!("program: output slot {o} is not below the {available} slots"))
            })
        })
        .collect::<NifResult<_>>()?;
    ffi::program_spec_outputs(spec.pin_mut(), &outs);
    Ok(ResourceArc::new(ProgramResource {
        id: PROGRAM_ID_BASE + next_id(),
        n_inputs,
        n_instrs: instrs.len(),
        outputs: outs.len(),
        compile,
        spec: Spec(spec),
        compiled: Default::default(),
        fits: Mutex::new(HashMap::new()),
    }))
}

/// A run's inputs, checked against the program, and the stream's worker.
fn call_args(
    op: &str,
    stream: &StreamArg,
    program: &ProgramResource,
    inputs: List<Live<TensorArg>>,
) -> NifResult<(Vec<TensorArg>, Arc<Worker>)> {
    let inputs: Vec<TensorArg> = inputs.0.into_iter().map(|t| t.0).collect();
    if inputs.len() != program.n_inputs {
        return Err(argument_error(format!(
            "{op}: the program takes {} inputs, got {}",
            program.n_inputs,
            inputs.len()
        )));
    }
    let worker = stream.get().ok_or_else(|| released_error(op, &stream.name))?;
    Ok((inputs, worker))
}

/// `program_run(stream, program, inputs)`: queues the program on `stream`'s worker and
/// returns its outputs at once, as lazy tensors (errors surface at the next waiting call,
/// like any op's). Inputs may live on any stream (lazy ones are evaluated there first).
#[rustler::nif]
fn program_run(
    stream: StreamArg,
    program: ResourceArc<ProgramResource>,
    inputs: List<Live<TensorArg>>,
) -> NifResult<Vec<TensorArg>> {
    const OP: &str = "program_run";
    let (inputs, worker) = call_args(OP, &stream, &program, inputs)?;
    let mut ins = Inputs::default();
    for t in &inputs {
        ins.push(t, Some(&worker));
    }
    let (outs, ids) = TensorResource::outputs(&worker, program.outputs);
    let device = worker.device;
    ins.request(OP);
    worker.submit_lazy(Box::new(move |st: &mut State| match run(st, &program, device, &mut ins) {
        Ok(mut out) => put_outputs(&mut st.arrays, ids, Ok(out.pin_mut())),
        Err(e) => put_outputs(&mut st.arrays, ids, Err(e)),
    }));
    Ok(outs)
}

/// `program_eval(stream, program, inputs)`: runs and evaluates the program right here, on
/// the calling (dirty) scheduler thread, and returns its outputs evaluated, as tensors of
/// `stream`; or `:pending`, touching nothing, when some input is not evaluated yet. A
/// compiled CPU program is called through its compiled copy for the threads that
/// evaluate it themselves (each thread's MLX compile cache holds its own entry); a
/// compiled GPU program answers `:worker`, touching nothing: MLX's CUDA fused kernels
/// are not safe to evaluate from several threads at once (an integer division by zero
/// inside `Compiled::eval_gpu`, seen on an H200 with eight threads), so it runs on its
/// stream's worker (`program_run`).
///
/// This skips the two thread hand-offs of `program_run` + `eval` (to the worker, and the
/// reply back). It is allowed by MLX's thread rules because the whole graph is built and
/// evaluated within this one call, on this thread's own stream, from evaluated inputs:
/// only evaluated arrays leave it. The threads that run it are the VM's fixed set of
/// dirty CPU schedulers, so the MLX streams it leaves behind stay few.
#[rustler::nif(schedule = "DirtyCpu")]
fn program_eval<'a>(
    env: Env<'a>,
    stream: StreamArg,
    program: ResourceArc<ProgramResource>,
    inputs: List<Live<TensorArg>>,
) -> NifResult<Term<'a>> {
    const OP: &str = "program_eval";
    let (inputs, worker) = call_args(OP, &stream, &program, inputs)?;
    if program.compile && worker.device != Device::Cpu {
        return Ok(crate::atoms::worker().encode(env));
    }
    let evaluated: Option<Vec<_>> = inputs.iter().map(|t| t.evaluated()).collect();
    let Some(evaluated) = evaluated else {
        return Ok(crate::atoms::pending().encode(env));
    };
    let v = crate::bridge::array_vec(evaluated.iter().map(|a| &*a.0));
    let signature = ffi::inputs_signature(&v);
    // A compiled graph too deep for this thread's stack to trace goes to the worker,
    // whose stack is larger (`run`).
    if program.compile {
        let fits =
            crate::worker::run_busy(|| program.compiles_here(&v, signature, worker.device)).map_err(|e| {
                let refs: Vec<&ffi::Array> = evaluated.iter().map(|a| &*a.0).collect();
                crate::error::raise(&mlx_error(OP, e, &refs))
            })?;
        if !fits {
            return Ok(crate::atoms::worker().encode(env));
        }
    }
    let res = crate::worker::run_busy(|| {
        let refs: Vec<&ffi::Array> = evaluated.iter().map(|a| &*a.0).collect();
        let device = worker.device as i32;
        let start = Instant::now();
        // A compiled graph's nodes, counted before MLX schedules them.
        let mut nodes = None;
        let mut out = if program.compile {
            program.compiled(worker.device).and_then(|c| {
                let out = ffi::compiled_call(&c.0, &v)?;
                nodes = Some(ffi::unscheduled_nodes(&out));
                ffi::async_eval_arrays(&out)?;
                Ok(out)
            })
        } else {
            ffi::program_dispatch_here(&program.spec.0, &v, device)
        }
        .map_err(|e| mlx_error(OP, e, &refs))?;
        if worker.device == Device::Cpu {
            program.handed_over(signature, start.elapsed(), false, nodes);
        }
        let copied = ffi::program_finish_here(out.pin_mut(), device).map_err(|e| mlx_error(OP, e, &refs))?;
        if copied && worker.device == Device::Cpu {
            program.strided(signature);
        }
        check_outputs(OP, &out, program.outputs)?;
        Ok::<_, Error>(evaluated_tensors(&worker, out))
    });
    match res {
        Ok(outs) => Ok(outs.encode(env)),
        Err(e) => Err(crate::error::raise(&e)),
    }
}

/// Graphs of at most this many MLX nodes may take `program_eval_async`. Handing a graph
/// to MLX waits for earlier work once more than ten groups of ten CPU dispatches are in
/// flight (counted over all streams), and a node takes about two dispatches: a graph
/// this small never waits there when MLX starts idle, so the call's time on its
/// scheduler is building and handing over, microseconds per node, whatever the nodes
/// compute.
const ASYNC_MAX_NODES: usize = 40;

/// The most instructions a program that `program_eval_async` takes uncounted may have:
/// one far longer is not built to be counted (an instruction that adds no node is rare).
const ASYNC_MAX_INSTRS: usize = 4 * ASYNC_MAX_NODES;

/// The most instructions a compiled program that `program_eval_async` takes may have: a
/// thread's first call traces the program, on the caller's scheduler. That first call
/// took 0.2 ms for a 64-op chain and 0.5-0.6 ms for 256 ops, evaluation
/// included; later calls 30-60 us. A longer program stays on the dirty scheduler, whose
/// round trip cost a compiled 167-instruction graph (bench/'s dropout) some 40 us a run.
const COMPILED_ASYNC_MAX_INSTRS: usize = 256;

/// A larger graph may take `program_eval_async` too when its last hand-over (building
/// it and handing it to MLX, MLX's waits for earlier work included) took at most this
/// long: the call then keeps its scheduler about as long as a small graph's that waits
/// out `ASYNC_WAIT`. Measured on whichever path ran the graph last, so a graph that
/// grows slower (a busier machine) goes back to the dirty scheduler at its next run.
/// Once taken, a graph stays while its hand-over is within `ASYNC_WAIT`, so that one
/// near the budget does not switch paths from run to run.
const HANDOVER_BUDGET: Duration = Duration::from_micros(500);

/// What the runs of a program have learned of it for one signature of its inputs'
/// shapes and dtypes: for `program_eval_async` (`async_fit`), and for a compiled
/// program, whether a thread's stack holds its tracing (`compiles_here`).
#[derive(Clone, Copy, Default)]
struct Fit {
    /// Whether it builds at most `ASYNC_MAX_NODES` nodes (counted once: `None` before).
    small: Option<bool>,
    /// Its last hand-over to MLX on the CPU device, on either path.
    handover: Option<Duration>,
    /// Whether that hand-over was `program_eval_async`'s.
    taken: bool,
    /// Whether `program_eval_async` sleeps on it at once, without polling: its
    /// evaluations end too long after the hand-over for a poll to catch them (see the
    /// NIF).
    slow: bool,
    /// Whether `program_eval` compiled it for these shapes on the CPU: MLX then holds
    /// their fused kernels process-wide, and another thread's first call only traces the
    /// program (see `program_eval_async`).
    compiled: bool,
    /// The depth of its graph (measured once, for a compiled program).
    depth: Option<usize>,
    /// Whether an output of it came out other than row-contiguous (a transpose's, say), on
    /// either path: `program_eval_async` then ends each output in MLX's `contiguous`.
    strided: bool,
}

/// Bytes of stack that mx::compile's tracing takes per level of a graph's depth, with
/// room to spare: it recurses along the graph, some 200 bytes a level on MLX 0.32.4 (a
/// chain of 2,000 ops overflowed a dirty scheduler's 320 KiB stack and killed the VM; one
/// of 20,000, a 2 MiB thread's).
const COMPILE_STACK_PER_LEVEL: usize = 512;

/// Whether the calling thread's stack holds mx::compile's tracing of a graph `depth` deep.
fn stack_holds(depth: usize) -> bool {
    depth.saturating_mul(COMPILE_STACK_PER_LEVEL) <= ffi::stack_left()
}

impl ProgramResource {
    /// What the runs so far have learned of the program for inputs of `signature`.
    fn fit(&self, signature: u64) -> Fit {
        self.fits.lock().unwrap().get(&signature).copied().unwrap_or_default()
    }

    /// Whether the calling thread's stack holds mx::compile's tracing of the program on
    /// inputs like `v` (whose signature is `signature`): its graph's depth, measured once
    /// per signature, times `COMPILE_STACK_PER_LEVEL`, against the stack left here.
    fn compiles_here(
        &self,
        v: &ffi::ArrayVec,
        signature: u64,
        device: Device,
    ) -> Result<bool, cxx::Exception> {
        let depth = match self.fit(signature).depth {
            Some(depth) => depth,
            None => {
                let depth = ffi::program_graph_depth(&self.spec.0, v, device as i32)?;
                self.fits.lock().unwrap().entry(signature).or_default().depth = Some(depth);
                depth
            }
        };
        Ok(stack_holds(depth))
    }

    fn compiled(&self, device: Device) -> Result<Arc<Compiled>, cxx::Exception> {
        let mut compiled = self.compiled[device as usize].lock().unwrap();
        if let Some(c) = &*compiled {
            return Ok(c.clone());
        }
        let id = self.id + ((device as u64 + 1) << 60);
        let c = Arc::new(Compiled(ffi::program_compile(&self.spec.0, id, device as i32)?));
        *compiled = Some(c.clone());
        Ok(c)
    }

    /// Notes that an output came out strided for inputs of `signature` (`Fit::strided`).
    fn strided(&self, signature: u64) {
        self.fits.lock().unwrap().entry(signature).or_default().strided = true;
    }

    /// Notes a run's hand-over, and, for a compiled program's dirty run, that it is
    /// compiled for these shapes and the nodes its compiled form builds (its fused
    /// kernels one node each): counting the program's own instructions would overstate
    /// them.
    fn handed_over(&self, signature: u64, took: Duration, taken: bool, compiled_nodes: Option<usize>) {
        let mut fits = self.fits.lock().unwrap();
        let fit = fits.entry(signature).or_default();
        fit.handover = Some(took);
        fit.taken = taken;
        if let Some(n) = compiled_nodes {
            fit.small = Some(n <= ASYNC_MAX_NODES);
            fit.compiled = true;
        }
    }
}

/// Whether `program_eval_async` takes `program` on inputs like `v` (signature
/// `signature`): when it builds at most `ASYNC_MAX_NODES` nodes (counted once per
/// signature, by building the graph and dropping it; a compiled program's, by the dirty
/// run that compiled it, which comes first), or when its last hand-over took
/// at most `HANDOVER_BUDGET` (`ASYNC_WAIT` if it was this NIF's). A program far longer
/// than the node bound is not built to be counted (the count runs on a normal scheduler
/// too): an instruction that adds no node is rare. `known` is what is known of it; returns
/// that, counted, and whether it is small, or `None` for the dirty scheduler.
fn async_fit(
    program: &ProgramResource,
    known: Fit,
    v: &ffi::ArrayVec,
    signature: u64,
) -> Option<(Fit, bool)> {
    // An entry made by a dirty run (its hand-over) may not be counted yet.
    let (fit, small) = match known.small {
        Some(small) => (known, small),
        None => {
            let small = program.n_instrs <= ASYNC_MAX_INSTRS
                && ffi::program_graph_size(&program.spec.0, v).is_ok_and(|n| n <= ASYNC_MAX_NODES);
            let mut fits = program.fits.lock().unwrap();
            let fit = fits.entry(signature).or_default();
            fit.small = Some(small);
            (*fit, small)
        }
    };
    let budget = if fit.taken { ASYNC_WAIT } else { HANDOVER_BUDGET };
    (small || fit.handover.is_some_and(|t| t <= budget)).then_some((fit, small))
}

/// Whether MLX counts no task group in flight (on any stream) and memory within its
/// limit, its own conditions for waiting while it queues a graph: then handing over a
/// small graph never waits inside MLX for others. MLX counts a group at every tenth
/// dispatch of a stream, so work may still be queued on this thread's stream (another
/// caller's that stopped waiting, one long matmul): it delays only the evaluation.
fn mlx_idle() -> bool {
    ffi::mlx_tasks_in_flight() == 0 && !ffi::mlx_memory_over_limit()
}

/// How long `program_eval_async` may keep its normal scheduler, building included: the
/// VM's guideline for a NIF call (met to within the deadline thread's tick).
const ASYNC_WAIT: Duration = Duration::from_millis(1);

/// How long `program_eval_async` polls for the outputs before it sleeps on them.
const ASYNC_POLL: Duration = Duration::from_micros(50);

/// `program_eval_async(stream, program, inputs, ref)`: `program_eval` without the dirty
/// scheduler, for a graph on the CPU device (evaluated inputs, small or quickly handed
/// over: `async_fit`; if compiled, compiled already for its inputs' shapes), while MLX
/// has no other evaluation in flight. It
/// builds the graph here, on this scheduler thread's own MLX stream, and hands its
/// evaluation to MLX's thread for that stream. If the outputs are computed within
/// `ASYNC_WAIT` of the call, it returns them (or raises their error). Otherwise it
/// returns a pending evaluation: MLX's thread sends `{ref, :ok}` or `{ref, {:error,
/// exception}}` when the outputs are computed, and `program_eval_take/1` then returns
/// them. Returns `:dirty` when the program does not qualify (the caller then uses
/// `program_eval`).
///
/// Why: during a dirty call the caller's scheduler has no work, and it busy-waits before
/// it sleeps, taking a core from MLX's and OpenBLAS's threads; then it must be woken
/// again. On two cores that cost a ~100 us graph 10-20% (bench/README.md). Here the
/// scheduler thread sleeps on the evaluation as Python's does, for at most `ASYNC_WAIT`
/// (see src/deadline.rs for why the sleep has no timeout of its own).
/// MLX's rules hold as for `program_eval`: the graph is built and evaluated on one
/// thread's stream, only evaluated arrays leave it, and the VM's normal schedulers are a
/// fixed set of threads. Handing a graph to MLX waits for earlier work past ten task
/// groups in flight, or with memory over its limit: `mlx_idle` checks both first; the
/// node bound keeps a small graph's own dispatches below that, and a larger graph's
/// waits for its own were measured short (`HANDOVER_BUDGET`). Work still queued on
/// this thread's stream (a caller's that stopped waiting) delays only the evaluation,
/// not the NIF's return. While the graph is queued, MLX's thread for the stream is held
/// in a spin, so that it takes the graph in one go (src/hold.rs).
#[rustler::nif]
fn program_eval_async<'a>(
    env: Env<'a>,
    stream: StreamArg,
    program: ResourceArc<ProgramResource>,
    inputs: List<Live<TensorArg>>,
    reference: Term<'a>,
) -> NifResult<Term<'a>> {
    const OP: &str = "program_eval";
    let start = Instant::now();
    let (inputs, worker) = call_args(OP, &stream, &program, inputs)?;
    if worker.device != Device::Cpu {
        return Ok(crate::atoms::dirty().encode(env));
    }
    let evaluated: Option<Vec<_>> = inputs.iter().map(|t| t.evaluated()).collect();
    let Some(evaluated) = evaluated else {
        return Ok(crate::atoms::dirty().encode(env));
    };
    let v = crate::bridge::array_vec(evaluated.iter().map(|a| &*a.0));
    let signature = ffi::inputs_signature(&v);
    let known = program.fit(signature);
    // A compiled program, once a dirty run has compiled it for these inputs' shapes: its
    // fused kernels exist then, and this thread's first call only traces it (on the
    // CPU, MLX's kernel library is process-wide; its compile cache, per thread). That
    // run measured its depth, which this thread's stack must hold.
    let here = match program.compile {
        false => None,
        // (Of at most `COMPILED_ASYNC_MAX_INSTRS` instructions: a thread's first call
        // traces the program, which holds the scheduler meanwhile.)
        true if program.n_instrs <= COMPILED_ASYNC_MAX_INSTRS
            && known.compiled
            && known.depth.is_some_and(stack_holds) =>
        {
            Some(program.compiled(Device::Cpu).map_err(|e| crate::error::raise(&mlx_error(OP, e, &[])))?)
        }
        true => return Ok(crate::atoms::dirty().encode(env)),
    };
    let (fit, small) = match mlx_idle().then(|| async_fit(&program, known, &v, signature)).flatten() {
        Some(found) => found,
        None => return Ok(crate::atoms::dirty().encode(env)),
    };
    let pending = ResourceArc::new(PendingEval {
        worker,
        outputs: Mutex::new(None),
        completion: Arc::default(),
        program: program.clone(),
        signature,
    });
    let done = Box::new(EvalDone {
        reply: Reply::new(env, reference),
        completion: pending.completion.clone(),
        inputs: evaluated.clone(),
        _busy: Busy::enter(),
    });
    // `done` holds the call (and the evaluation after it) busy for the exit guard.
    let queued = {
        let _hold = crate::hold::Hold::cpu_stream();
        match &here {
            Some(here) => ffi::compiled_eval_async(&here.0, &v, fit.strided, done),
            None => ffi::program_eval_async(&program.spec.0, &v, fit.strided, done),
        }
    };
    let out = queued.map_err(|e| {
        let refs: Vec<&ffi::Array> = evaluated.iter().map(|a| &*a.0).collect();
        crate::error::raise(&mlx_error(OP, e, &refs))
    })?;
    if !small {
        program.handed_over(signature, start.elapsed(), true, None);
    }
    check_outputs(OP, &out, program.outputs).map_err(|e| crate::error::raise(&e))?;
    *pending.outputs.lock().unwrap() = Some(out);

    let c = &pending.completion;
    // A small graph is often computed within microseconds: polling first spares it a
    // sleep and a wake-up (each some 20 us on the VM the bench runs on). Yielding, so
    // that MLX's and BLAS's threads keep the core whenever they want it; even so, a
    // poll that cannot succeed takes CPU time from them, so a graph whose evaluations
    // outlast the poll sleeps at once (bench/README.md: the MLP's mean run went from
    // 126-132 to 111-113 us).
    let handed = Instant::now();
    let poll_until = handed + if fit.slow { Duration::ZERO } else { ASYNC_POLL };
    while !c.computed.load(Ordering::Acquire) && Instant::now() < poll_until {
        std::thread::yield_now();
    }
    // Computed already, the common case: no deadline to watch (a watch would wake the
    // deadline thread and keep it ticking).
    let _ticket = (!c.computed.load(Ordering::Acquire))
        .then(|| crate::deadline::watch(start + ASYNC_WAIT, Arc::downgrade(c) as Weak<_>));
    let mut progress =
        c.finished.wait_while(c.progress.lock().unwrap(), |p| p.result.is_none() && !p.expired).unwrap();
    // Timed by MLX's thread, so that a sleep's wake-up does not count. Polling only
    // where it is well inside the window (a graph near its end would poll in vain in
    // some runs), and back only where it is clearly quicker.
    let slow = match progress.computed_at.map(|at| at.duration_since(handed)) {
        None => true,
        Some(took) if fit.slow => took > ASYNC_POLL / 4,
        Some(took) => took > ASYNC_POLL / 2,
    };
    if slow != fit.slow {
        program.fits.lock().unwrap().entry(signature).or_default().slow = slow;
    }
    rustler::schedule::consume_timeslice(env, (start.elapsed().as_micros() / 10).min(100) as i32);
    match progress.result.take() {
        Some(Ok(())) => {
            drop(progress);
            take_outputs(env, &pending)
        }
        Some(Err(e)) => Err(crate::error::raise(&e)),
        None => {
            progress.detached = true;
            drop(progress);
            Ok(pending.encode(env))
        }
    }
}

/// An evaluation handed to MLX's thread by `program_eval_async`.
pub struct PendingEval {
    worker: Arc<Worker>,
    /// The outputs, set before the NIF returns; taken once they are computed.
    outputs: Mutex<Option<cxx::UniquePtr<ffi::ArrayVec>>>,
    completion: Arc<Completion>,
    /// The program and its inputs' signature, for what the outputs teach of it.
    program: ResourceArc<ProgramResource>,
    signature: u64,
}

// SAFETY: the outputs are not read from another thread before they are computed (they
// are then evaluated arrays, which may cross threads); until then MLX's thread holds its
// own handles to them.
unsafe impl Send for PendingEval {}
unsafe impl Sync for PendingEval {}

#[rustler::resource_impl]
impl Resource for PendingEval {}

/// How a pending evaluation stands, between the NIF waiting on it, MLX's thread and the
/// deadline thread.
#[derive(Default)]
pub struct Completion {
    progress: Mutex<Progress>,
    finished: Condvar,
    /// Whether `progress.computed_at` is set, readable without the lock (for the NIF's
    /// polling).
    computed: AtomicBool,
}

#[derive(Default)]
struct Progress {
    /// Set by MLX's thread once the outputs are computed (for the waiting NIF).
    result: Option<Result<(), Error>>,
    /// Set by the deadline thread: the NIF is to stop waiting.
    expired: bool,
    /// The NIF stopped waiting: MLX's thread sends the result as a message instead.
    detached: bool,
    /// When MLX's thread saw the outputs computed (either way they are reported).
    computed_at: Option<Instant>,
}

impl crate::deadline::Expire for Completion {
    fn expire(&self) {
        self.progress.lock().unwrap().expired = true;
        self.finished.notify_all();
    }
}

/// The end of a pending evaluation, held by MLX's thread (see `program_eval_async`).
pub struct EvalDone {
    reply: Reply,
    completion: Arc<Completion>,
    /// The inputs, for an error's description.
    inputs: Vec<Arc<SendArray>>,
    _busy: Busy,
}

/// Called by MLX's stream thread (cpp/program.cc) once the outputs are computed: wakes
/// the NIF waiting on them, or, if it stopped waiting, tells the caller. Never unwinds
/// into C++.
pub fn eval_done(done: Box<EvalDone>, error: &str) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let EvalDone { reply, completion, inputs, _busy } = *done;
        let result = match error {
            "" => Ok(()),
            message => {
                let refs: Vec<&ffi::Array> = inputs.iter().map(|a| &*a.0).collect();
                Err(crate::tensor::mlx_error_message("program_eval", message, &refs))
            }
        };
        let mut progress = completion.progress.lock().unwrap();
        progress.computed_at = Some(Instant::now());
        completion.computed.store(true, Ordering::Release);
        if progress.detached {
            drop(progress);
            reply.send(|env| match result {
                Ok(()) => crate::atoms::ok().encode(env),
                Err(e) => (crate::atoms::error(), e.to_exception()).encode(env),
            });
        } else {
            progress.result = Some(result);
            // Notified once the lock is released, or the waking thread would block on it.
            drop(progress);
            completion.finished.notify_all();
        }
    }));
}

/// `program_eval_take(pending)`: the outputs of a pending evaluation, once its `{ref,
/// :ok}` has arrived, as evaluated tensors of the stream it was started for; `:dirty`
/// if they must be computed again there (see `take_outputs`).
#[rustler::nif]
fn program_eval_take<'a>(env: Env<'a>, pending: ResourceArc<PendingEval>) -> NifResult<Term<'a>> {
    if pending.completion.progress.lock().unwrap().computed_at.is_none() {
        return Err(argument_error("program_eval_take: the evaluation has not finished"));
    }
    take_outputs(env, &pending)
}

/// The computed outputs of `pending` as tensors, or `:dirty` when one is not
/// row-contiguous, as a tensor's evaluated array must be. `program_eval_async` builds
/// the graph without MLX's `contiguous` until some output of the program has come out
/// otherwise for these inputs' shapes (most never do, and each `contiguous` costs MLX's
/// thread two tasks: some 4% of the time of bench/'s compiled MLP training step, whose
/// 19 outputs each had one). Once one has (on either path), the program is noted to need
/// it; if it is this run's, its outputs are dropped for `program_eval` to compute again
/// on the dirty path, which copies those that are strided (a program has no side
/// effects, and this happens at most once per signature).
fn take_outputs<'a>(env: Env<'a>, pending: &PendingEval) -> NifResult<Term<'a>> {
    let out = pending
        .outputs
        .lock()
        .unwrap()
        .take()
        .ok_or_else(|| argument_error("program_eval_take: the outputs were taken already"))?;
    if !ffi::row_contiguous(&out) {
        pending.program.strided(pending.signature);
        return Ok(crate::atoms::dirty().encode(env));
    }
    Ok(evaluated_tensors(&pending.worker, out).encode(env))
}

/// Evaluated outputs as tensors of `worker`'s stream.
fn evaluated_tensors(worker: &Arc<Worker>, mut out: cxx::UniquePtr<ffi::ArrayVec>) -> Vec<TensorArg> {
    (0..ffi::array_vec_len(&out))
        .map(|i| {
            let a = ffi::array_vec_take(out.pin_mut(), i).expect("index below the length");
            TensorResource::from_evaluated(worker, a)
        })
        .collect()
}

fn run(
    st: &mut State,
    p: &ProgramResource,
    device: Device,
    ins: &mut Inputs,
) -> Result<cxx::UniquePtr<ffi::ArrayVec>, Error> {
    const OP: &str = "program_run";
    let st = &*st;
    let refs = ins.resolve(&st.arrays, OP)?;
    let v = crate::bridge::array_vec(refs.iter().copied());
    // A compiled graph too deep even for the worker's stack to trace runs uncompiled.
    let compiled = p.compile
        && p.compiles_here(&v, ffi::inputs_signature(&v), device).map_err(|e| mlx_error(OP, e, &refs))?;
    let start = Instant::now();
    let out = if compiled {
        p.compiled(device).and_then(|c| ffi::compiled_call(&c.0, &v))
    } else {
        ffi::program_call(&p.spec.0, &v, &st.stream)
    }
    .map_err(|e| mlx_error(OP, e, &refs))?;
    BUILD_NANOS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    BUILD_RUNS.fetch_add(1, Ordering::Relaxed);
    check_outputs(OP, &out, p.outputs)?;
    Ok(out)
}

/// The workers' time in `run` building programs' graphs (MLX's lazy nodes, nothing
/// evaluated), over every program and stream since the NIF was loaded, and those runs.
static BUILD_NANOS: AtomicU64 = AtomicU64::new(0);
static BUILD_RUNS: AtomicU64 = AtomicU64::new(0);

/// `program_build_time()`: `{runs, microseconds}` of `program_run`'s graph building so far.
#[rustler::nif]
fn program_build_time() -> (u64, u64) {
    (BUILD_RUNS.load(Ordering::Relaxed), BUILD_NANOS.load(Ordering::Relaxed) / 1000)
}

/// `program_info(program)`: `%{inputs:, instructions:, outputs:, compile:, tapes:}`.
#[rustler::nif]
fn program_info<'a>(env: Env<'a>, program: ResourceArc<ProgramResource>) -> NifResult<Term<'a>> {
    let keys = ["inputs", "instructions", "outputs", "compile", "tapes"];
    let values = [
        program.n_inputs.encode(env),
        program.n_instrs.encode(env),
        program.outputs.encode(env),
        program.compile.encode(env),
        ffi::program_tapes(&program.spec.0).encode(env),
    ];
    let keys: Vec<Term> = keys.iter().map(|k| rustler::Atom::from_str(env, k).unwrap().encode(env)).collect();
    Term::map_from_arrays(env, &keys, &values)
}

/// `program_compiled(program)`: whether the program was built with `compile: true`, asked
/// on the normal scheduler (`program_eval` would answer `:pending` only after the hop to
/// a dirty one).
#[rustler::nif]
fn program_compiled(program: ResourceArc<ProgramResource>) -> bool {
    program.compile
}

/// `op_table()`: `[{name, id, outputs}]` for every op a program can use, from the table
/// the build generated: the op ids the NIFs and the C++ dispatch use.
#[rustler::nif]
fn op_table<'a>(env: Env<'a>) -> Vec<Term<'a>> {
    FAMILIES
        .iter()
        .flat_map(|f| f.iter())
        .map(|e| (rustler::Atom::from_str(env, e.name).unwrap(), e.id, e.outputs).encode(env))
        .collect()
}
