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
#[path = "../src/queue.rs"]
mod queue;

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

#[test]
fn queue_hands_out_jobs_oldest_first_across_batches() {
    let q = queue::Queue::default();
    let mut taken = std::collections::VecDeque::new();
    q.push(1);
    q.push(2);
    q.take_into(&mut taken);
    q.push(3);
    assert!(!q.is_empty());
    q.take_into(&mut taken);
    assert!(q.is_empty());
    assert_eq!(Vec::from(taken), vec![1, 2, 3]);
}

#[test]
fn queue_keeps_each_producers_order_under_contention() {
    use std::sync::Arc;
    const PRODUCERS: usize = 4;
    const EACH: usize = 20_000;
    let q = Arc::new(queue::Queue::default());
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let q = q.clone();
            std::thread::spawn(move || (0..EACH).for_each(|i| q.push((p, i))))
        })
        .collect();
    let mut next = [0usize; PRODUCERS];
    let mut taken = std::collections::VecDeque::new();
    let mut seen = 0;
    while seen < PRODUCERS * EACH {
        q.take_into(&mut taken);
        for (p, i) in taken.drain(..) {
            assert_eq!(i, next[p], "producer {p} out of order");
            next[p] += 1;
            seen += 1;
        }
    }
    producers.into_iter().for_each(|t| t.join().unwrap());
    assert!(q.is_empty());
}

#[test]
fn queue_drops_what_was_never_taken() {
    let item = std::sync::Arc::new(());
    let q = queue::Queue::default();
    q.push(item.clone());
    q.push(item.clone());
    q.close();
    assert!(q.is_closed());
    drop(q);
    assert_eq!(std::sync::Arc::strong_count(&item), 1);
}
