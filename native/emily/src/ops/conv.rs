//! Convolution ops: NIFs generated from `optable/conv.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_conv.rs"));
