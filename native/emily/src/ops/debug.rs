//! Debug checks: NIFs generated from `optable/debug.ops` (used by `Emily.Debug`).
include!(concat!(env!("OUT_DIR"), "/nifs_debug.rs"));
