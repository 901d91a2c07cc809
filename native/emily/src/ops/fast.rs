//! Fast-kernel ops: NIFs generated from `optable/fast.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_fast.rs"));
