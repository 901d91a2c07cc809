//! Unary ops: NIFs generated from `optable/unary.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_unary.rs"));
