//! Holding MLX's thread for a CPU stream while `program_eval_async` queues a graph to it.
//!
//! MLX queues a graph task by task (two or more per op), and its thread for the stream
//! sleeps whenever its queue runs dry: computing each small op as soon as it is queued, it
//! sleeps between them, and each next task must wake it, a system call for the queueing
//! thread that is slow wherever waking a thread on another core is (bench/README.md:
//! MLX's queueing of the MLP went from 35-48 to 18-23 us on the bench's VM). A task queued
//! first holds the thread in a spin (yielding its core to any thread that wants it) until
//! the graph is queued, so that it takes the graph in one go.
//!
//! The hold ends when the queueing ends (`Hold` dropped, however the call returns), or by
//! itself before MLX would wait for its thread: MLX waits with more than 10 task groups in
//! flight, or with memory over its limit. And after `HOLD_MAX` at most, should the
//! queueing thread be descheduled midway.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bridge::ffi;

/// Task groups in flight at which the held thread lets go (MLX waits past 10).
const HOLD_TASKS: i32 = 8;
/// The longest a hold lasts.
const HOLD_MAX: Duration = Duration::from_micros(500);

/// The held side: run by MLX's thread (`hold_run`), until its flag is set.
pub struct HoldTask(Arc<AtomicBool>);

/// Holds MLX's thread for the calling thread's default CPU stream until dropped.
pub struct Hold(Arc<AtomicBool>);

impl Hold {
    pub fn cpu_stream() -> Hold {
        let open = Arc::new(AtomicBool::new(false));
        // Fails only once MLX's threads are stopping (process exit): then nothing is held.
        let _ = ffi::hold_cpu_stream(Box::new(HoldTask(open.clone())));
        Hold(open)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Called by MLX's stream thread (cpp/program.cc): spins until the hold ends. Never
/// unwinds into C++.
pub fn hold_run(task: &HoldTask) {
    let HoldTask(open) = task;
    let _ = std::panic::catch_unwind(|| {
        let until = Instant::now() + HOLD_MAX;
        let mut spins = 0u32;
        while !open.load(Ordering::Acquire) {
            spins += 1;
            if spins.is_multiple_of(16)
                && (ffi::mlx_tasks_in_flight() >= HOLD_TASKS
                    || ffi::mlx_memory_over_limit()
                    || Instant::now() > until)
            {
                return;
            }
            std::thread::yield_now();
        }
    });
}
