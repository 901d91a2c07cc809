//! Types ops: NIFs generated from `optable/types.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_types.rs"));
