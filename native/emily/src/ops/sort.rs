//! Sort ops: NIFs generated from `optable/sort.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_sort.rs"));
