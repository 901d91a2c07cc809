//! Emily's NIF: MLX for the BEAM.
//!
//! Layout: `worker` (one thread per MLX stream), `stream` and `tensor` (the resources
//! Elixir holds), `ops/` (one module per op family, generated from `optable/`),
//! `bridge` (the cxx surface over MLX's C++ API, C++ side in `cpp/`), `dtype`, `error`.

// Rust's own allocations only (see Cargo.toml); MLX allocates with the C library.
#[cfg(not(any(all(windows, target_env = "gnu"), all(target_os = "linux", target_env = "musl"))))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod bridge;
pub mod cache_dir;
pub mod deadline;
pub mod dtype;
pub mod error;
pub mod hold;
pub mod ops;
pub mod queue;
pub mod stream;
pub mod tensor;
pub mod term;
pub mod worker;

pub(crate) mod atoms {
    rustler::atoms! { ok, error, cpu, gpu, already_released, pending, dirty, worker }
}

rustler::init!("Elixir.Emily.Native");
