//! The cxx bridge: the whole C++ surface Emily calls. Every op goes through `op_call`,
//! whose per-op cases are generated from the op table (build/codegen.rs).
#[cxx::bridge(namespace = "emily")]
pub mod ffi {
    extern "Rust" {
        /// Called at process exit: waits (boundedly) for running jobs to finish, and
        /// keeps workers from starting new ones.
        fn quiesce_workers();

        /// The end of an asynchronous evaluation (src/ops/program.rs): called on MLX's
        /// stream thread once the outputs are computed, with its error ("" if none).
        type EvalDone;
        fn eval_done(done: Box<EvalDone>, error: &str);

        /// A hold on MLX's thread for a CPU stream (src/hold.rs): run on that thread, it
        /// returns when the hold ends.
        type HoldTask;
        fn hold_run(task: &HoldTask);
    }

    unsafe extern "C++" {
        include!("emily.h");

        #[namespace = "mlx::core"]
        #[cxx_name = "array"]
        type Array;
        #[namespace = "mlx::core"]
        type Stream;
        type ArrayVec;

        fn array_vec_new(capacity: usize) -> UniquePtr<ArrayVec>;
        fn array_vec_push(v: Pin<&mut ArrayVec>, a: &Array);
        fn array_vec_len(v: &ArrayVec) -> usize;
        fn array_vec_clear(v: Pin<&mut ArrayVec>);
        fn array_vec_take(v: Pin<&mut ArrayVec>, i: usize) -> Result<UniquePtr<Array>>;

        fn mlx_version() -> String;
        fn cuda_kernels_available() -> bool;
        fn device_available(device: i32) -> Result<bool>;
        fn stream_new(device: i32) -> Result<UniquePtr<Stream>>;
        fn synchronize(s: &Stream) -> Result<()>;
        fn stream_set_default(s: &Stream) -> Result<()>;
        fn install_exit_guard() -> Result<()>;

        fn loads_released();
        fn loads_prune();
        fn loads_clear();
        fn from_bytes(data: &[u8], shape: &[i32], dtype_val: u8, dtype_size: u8) -> Result<UniquePtr<Array>>;
        fn clone_array(a: &Array) -> UniquePtr<Array>;
        fn export_array(a: &Array, s: &Stream) -> Result<UniquePtr<Array>>;
        fn eval_arrays(v: &ArrayVec) -> Result<()>;
        fn async_eval_arrays(v: &ArrayVec) -> Result<()>;
        fn array_data(a: &Array) -> *const u8;
        fn array_nbytes(a: &Array) -> usize;
        fn array_shape(a: &Array) -> Vec<i32>;
        fn array_dtype_val(a: &Array) -> u8;

        // memory.h
        include!("memory.h");
        fn memory_active() -> Result<u64>;
        fn memory_peak() -> Result<u64>;
        fn memory_cache() -> Result<u64>;
        fn memory_limit() -> Result<u64>;
        fn memory_reset_peak() -> Result<()>;
        fn memory_clear_cache() -> Result<()>;
        fn memory_set_limit(limit: u64) -> Result<u64>;
        fn memory_set_cache_limit(limit: u64) -> Result<u64>;
        fn memory_set_wired_limit(limit: u64) -> Result<u64>;
        fn metal_available() -> Result<bool>;
        fn malloc_tune(mmap_threshold: i32, trim_threshold: i32) -> bool;

        // distributed.h
        include!("distributed.h");
        fn distributed_init(
            backend: &str,
            rank: i32,
            size: i32,
            hostfile: &str,
            coordinator: &str,
            timeout_ms: i64,
        ) -> Result<i64>;
        fn distributed_release(id: i64);
        fn distributed_available(backend: &str) -> Result<bool>;

        // program.h
        include!("program.h");
        type ProgramSpec;
        type Compiled;
        fn program_spec_new(n_inputs: usize) -> UniquePtr<ProgramSpec>;
        #[allow(clippy::too_many_arguments)]
        fn program_spec_push(
            p: Pin<&mut ProgramSpec>,
            op: u32,
            name: &str,
            slots: &[u32],
            ints: &[i64],
            floats: &[f64],
            strs: &[String],
            outputs: u32,
        );
        fn program_spec_outputs(p: Pin<&mut ProgramSpec>, slots: &[u32]);
        fn program_tapes(p: &ProgramSpec) -> usize;
        fn program_call(p: &ProgramSpec, inputs: &ArrayVec, s: &Stream) -> Result<UniquePtr<ArrayVec>>;
        fn program_dispatch_here(
            p: &ProgramSpec,
            inputs: &ArrayVec,
            device: i32,
        ) -> Result<UniquePtr<ArrayVec>>;
        fn program_finish_here(outputs: Pin<&mut ArrayVec>, device: i32) -> Result<bool>;
        fn program_eval_async(
            p: &ProgramSpec,
            inputs: &ArrayVec,
            contiguous: bool,
            done: Box<EvalDone>,
        ) -> Result<UniquePtr<ArrayVec>>;
        fn row_contiguous(v: &ArrayVec) -> bool;
        fn program_graph_size(p: &ProgramSpec, inputs: &ArrayVec) -> Result<usize>;
        fn inputs_signature(inputs: &ArrayVec) -> u64;
        fn unscheduled_nodes(outputs: &ArrayVec) -> usize;
        fn program_graph_depth(p: &ProgramSpec, inputs: &ArrayVec, device: i32) -> Result<usize>;
        fn stack_left() -> usize;
        fn hold_cpu_stream(task: Box<HoldTask>) -> Result<()>;
        fn mlx_tasks_in_flight() -> i32;
        fn mlx_memory_over_limit() -> bool;
        fn program_compile(p: &ProgramSpec, id: u64, device: i32) -> Result<UniquePtr<Compiled>>;
        fn compiled_call(c: &Compiled, inputs: &ArrayVec) -> Result<UniquePtr<ArrayVec>>;
        fn compiled_eval_async(
            c: &Compiled,
            inputs: &ArrayVec,
            contiguous: bool,
            done: Box<EvalDone>,
        ) -> Result<UniquePtr<ArrayVec>>;

        fn op_call(
            op: u32,
            tensors: &ArrayVec,
            ints: &[i64],
            floats: &[f64],
            strs: &[String],
            s: &Stream,
            out: Pin<&mut ArrayVec>,
        ) -> Result<()>;
    }
}

/// An `ArrayVec` of `arrays`, sized up front (pushing an MLX array copies a handle, not data).
pub fn array_vec<'a>(arrays: impl ExactSizeIterator<Item = &'a ffi::Array>) -> cxx::UniquePtr<ffi::ArrayVec> {
    let mut v = ffi::array_vec_new(arrays.len());
    for a in arrays {
        ffi::array_vec_push(v.pin_mut(), a);
    }
    v
}

use crate::hold::{hold_run, HoldTask};
use crate::ops::program::{eval_done, EvalDone};

fn quiesce_workers() {
    crate::worker::quiesce(std::time::Duration::from_secs(5));
}

/// An evaluated array, safe to read from any thread: MLX only forbids *lazy* arrays from
/// crossing threads. It is dropped on a worker thread (see `tensor.rs`).
pub struct SendArray(pub cxx::UniquePtr<ffi::Array>);
// SAFETY: only evaluated arrays are wrapped; their buffers are immutable and MLX's
// refcounts are atomic.
unsafe impl Send for SendArray {}
unsafe impl Sync for SendArray {}
