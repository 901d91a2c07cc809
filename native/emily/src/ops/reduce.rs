//! Reduce ops: NIFs generated from `optable/reduce.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_reduce.rs"));
