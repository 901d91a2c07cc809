//! FFT ops: NIFs generated from `optable/fft.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_fft.rs"));
