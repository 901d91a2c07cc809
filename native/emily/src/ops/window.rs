//! Window ops: NIFs generated from `optable/window.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_window.rs"));
