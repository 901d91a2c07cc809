//! The op table: `optable/*.ops`, one file per op family, one row per NIF.
//!
//! It is the single source of truth for the native surface. `build.rs` turns each row into
//! a Rust NIF and a C++ dispatch case; `Emily.Native` (Elixir) reads the same files to
//! define its stubs. Row grammar:
//!
//! ```text
//! name  arg:type ...  [-> N]  = C++ expression      # built on the stream's worker
//! name  arg:type ...          custom                 # hand-written NIF in src/
//! ```
//!
//! `-> N` is a fixed output count, or the name of an argument that gives it at call time:
//! an `int` (its value), or an `ints` or `tensors` list (its length), e.g. `split` into
//! `-> sizes` parts.
//!
//! In an expression row the NIF takes the stream first, then the listed args; the C++
//! expression sees every arg under its own name, `s` for the stream, and `using namespace
//! mlx::core`. It returns an `array` or a `std::vector<array>` of N outputs.
//!
//! Arg types: `tensor`, `tensor?` (optional, nil), `tensors` (a list), `int` (a C++ `int`:
//! a value outside 32 bits raises `ArgumentError` at the call, as it would wrap in MLX's
//! axes, sizes and counts), `int64` (an `int64_t`, for the values MLX really takes as 64-bit:
//! seeds, byte counts, element offsets, scalars that become int64 arrays), `ints` (32-bit
//! each), `shape`, `float`, `bool`, `dtype`, `str`; and in custom rows `term` and `stream`.
//! A custom row's NIF decodes its own args: its types there document them.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgType {
    Tensor,
    OptTensor,
    Tensors,
    /// Checked to fit in 32 bits; the C++ expression sees an `int`.
    Int,
    /// The C++ expression sees an `int64_t`.
    Int64,
    Ints,
    Shape,
    Float,
    Bool,
    DType,
    Str,
    /// Custom rows only: any term (refs, pids, binaries, options).
    Term,
    /// Custom rows only: a stream.
    Stream,
}

impl ArgType {
    fn parse(s: &str) -> Option<ArgType> {
        Some(match s {
            "tensor" => ArgType::Tensor,
            "tensor?" => ArgType::OptTensor,
            "tensors" => ArgType::Tensors,
            "int" => ArgType::Int,
            "int64" => ArgType::Int64,
            "ints" => ArgType::Ints,
            "shape" => ArgType::Shape,
            "float" => ArgType::Float,
            "bool" => ArgType::Bool,
            "dtype" => ArgType::DType,
            "str" => ArgType::Str,
            "term" => ArgType::Term,
            "stream" => ArgType::Stream,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arg {
    pub name: String,
    pub ty: ArgType,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    Expr(String),
    Custom,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub family: String,
    pub name: String,
    pub args: Vec<Arg>,
    /// The fixed output count; 0 when `outputs_from` names the argument that gives it.
    pub outputs: usize,
    pub outputs_from: Option<String>,
    pub body: Body,
    pub line: usize,
}

/// Parses one table file. `family` is the file's stem.
pub fn parse(family: &str, text: &str) -> Result<Vec<Op>, String> {
    let mut ops = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |m: &str| format!("optable/{family}.ops:{}: {m}: {raw}", i + 1);
        let (head, body) = match line.split_once('=') {
            Some((h, e)) => (h.trim(), Body::Expr(e.trim().to_string())),
            None => match line.strip_suffix("custom") {
                Some(h) => (h.trim(), Body::Custom),
                None => return Err(err("expected `= expr` or `custom`")),
            },
        };
        let (head, outputs, outputs_from) = match head.split_once("->") {
            Some((h, n)) => match n.trim().parse() {
                Ok(n) => (h.trim(), n, None),
                Err(_) => (h.trim(), 0, Some(n.trim().to_string())),
            },
            None => (head, 1, None),
        };
        let mut words = head.split_whitespace();
        let name = words.next().ok_or_else(|| err("missing name"))?.to_string();
        if !name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
            return Err(err("names are lower_snake_case"));
        }
        let mut args = Vec::new();
        for w in words {
            let (n, t) = w.split_once(':').ok_or_else(|| err("args are name:type"))?;
            let ty = ArgType::parse(t).ok_or_else(|| err(&format!("unknown type `{t}`")))?;
            if matches!(body, Body::Expr(_)) && matches!(ty, ArgType::Term | ArgType::Stream) {
                return Err(err("term/stream args are for custom rows"));
            }
            args.push(Arg { name: n.to_string(), ty });
        }
        if let Some(from) = &outputs_from {
            let counts = |a: &Arg| matches!(a.ty, ArgType::Int | ArgType::Ints | ArgType::Tensors);
            if !args.iter().any(|a| &a.name == from && counts(a)) || matches!(body, Body::Custom) {
                return Err(err("`-> name` must name an int, ints or tensors argument"));
            }
        }
        ops.push(Op { family: family.to_string(), name, args, outputs, outputs_from, body, line: i + 1 });
    }
    Ok(ops)
}
