//! Binary ops: NIFs generated from `optable/binary.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_binary.rs"));
