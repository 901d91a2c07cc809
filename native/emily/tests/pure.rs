//! Rust-side logic that needs no BEAM: the op table parser, the dtype table, error
//! messages. The modules are included by path so this binary never links the NIF.
#[path = "../src/dtype.rs"]
#[allow(dead_code)]
mod dtype;
#[path = "../src/error.rs"]
#[allow(dead_code)]
mod error;
#[path = "../build/optable.rs"]
mod optable;

use optable::{parse, ArgType, Body};

#[test]
fn parses_rows() {
    let ops = parse(
        "t",
        "# comment\nsum a:tensor axes:ints keepdims:bool = sum(a, axes, keepdims, s)\n\
         qr a:tensor -> 2 = linalg::qr(a, s)\nto_binary ref:term t:tensor custom\n",
    )
    .unwrap();
    assert_eq!(ops.len(), 3);
    assert_eq!(ops[0].name, "sum");
    assert_eq!(ops[0].args[1].ty, ArgType::Ints);
    assert_eq!(ops[0].body, Body::Expr("sum(a, axes, keepdims, s)".into()));
    assert_eq!(ops[1].outputs, 2);
    assert_eq!(ops[2].body, Body::Custom);
}

#[test]
fn int_types() {
    let ops = parse("t", "f a:tensor axis:int seed:int64 = f(a, axis, seed, s)").unwrap();
    assert_eq!(ops[0].args[1].ty, ArgType::Int);
    assert_eq!(ops[0].args[2].ty, ArgType::Int64);
    // An output count comes from a 32-bit int, never an int64.
    assert!(parse("t", "f a:tensor n:int64 -> n = f(a, n, s)").is_err());
}

#[test]
fn output_count_from_an_argument() {
    let ops = parse(
        "t",
        "split a:tensor sizes:ints axis:int -> sizes = f(a, sizes, axis, s)\n\
         mesh ts:tensors -> ts = g(ts, s)\nparts a:tensor n:int -> n = h(a, n, s)\n",
    )
    .unwrap();
    assert_eq!(ops[0].outputs_from.as_deref(), Some("sizes"));
    assert_eq!(ops[1].outputs_from.as_deref(), Some("ts"));
    assert_eq!(ops[2].outputs_from.as_deref(), Some("n"));
    assert_eq!(ops[2].outputs, 0);
    // Only int, ints and tensors arguments can give a count.
    assert!(parse("t", "f a:tensor x:float -> x = f(a, x, s)").is_err());
    assert!(parse("t", "f a:tensor -> b = f(a, s)").is_err());
}

#[test]
fn rejects_bad_rows() {
    assert!(parse("t", "Bad a:tensor = x").is_err());
    assert!(parse("t", "f a:wat = x").is_err());
    assert!(parse("t", "f a = x").is_err());
    assert!(parse("t", "f a:tensor").is_err());
    assert!(parse("t", "f r:term = x(r)").is_err());
}

#[test]
fn every_table_file_parses() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/optable");
    let mut names = std::collections::HashSet::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let fam = p.file_stem().unwrap().to_string_lossy().to_string();
        for op in parse(&fam, &std::fs::read_to_string(&p).unwrap()).unwrap() {
            assert!(names.insert(op.name.clone()), "duplicate {}", op.name);
        }
    }
    assert!(names.len() > 40);
}
