//! Creation ops: NIFs generated from `optable/creation.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_creation.rs"));
