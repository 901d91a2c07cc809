//! Emily's NIF: MLX for the BEAM.
//!
//! Layout: `worker` (one thread per MLX stream), `stream` and `tensor` (the resources
//! Elixir holds), `ops/` (one module per op family, generated from `optable/`),
//! `bridge` (the cxx surface over MLX's C++ API, C++ side in `cpp/`), `dtype`, `error`.
pub mod bridge;
pub mod dtype;
pub mod error;
pub mod ops;
pub mod stream;
pub mod tensor;
pub mod term;
pub mod worker;

pub(crate) mod atoms {
    rustler::atoms! { ok, error, cpu, gpu, already_released, pending }
}

rustler::init!("Elixir.Emily.Native");
