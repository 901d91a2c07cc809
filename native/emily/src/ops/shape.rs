//! Shape ops: NIFs generated from `optable/shape.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_shape.rs"));
