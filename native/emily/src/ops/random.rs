//! Random ops: NIFs generated from `optable/random.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_random.rs"));
