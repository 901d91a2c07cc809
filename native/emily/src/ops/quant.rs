//! Quantization ops: NIFs generated from `optable/quant.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_quant.rs"));
