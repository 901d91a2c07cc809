//! Scan ops: NIFs generated from `optable/scan.ops`.
include!(concat!(env!("OUT_DIR"), "/nifs_scan.rs"));
