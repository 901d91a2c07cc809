//! Index ops: NIFs generated from `optable/index.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_index.rs"));
