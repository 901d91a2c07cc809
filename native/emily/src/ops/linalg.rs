//! Linalg ops: NIFs generated from `optable/linalg.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_linalg.rs"));
