//! Decoders for the argument kinds of the op table that need checks before native work.
use crate::error::argument_error;
use rustler::{Atom, Decoder, NifResult, Term, TermType};

mod atoms {
    rustler::atoms! { nan, infinity, neg_infinity }
}

/// A shape: a list or tuple of non-negative integers.
pub struct Shape(pub Vec<i64>);

impl<'a> Decoder<'a> for Shape {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        let dims: Vec<i64> = match term.get_type() {
            TermType::Tuple => rustler::types::tuple::get_tuple(term)?
                .into_iter()
                .map(|t| t.decode::<i64>())
                .collect::<NifResult<_>>()
                .map_err(|_| argument_error(format!("expected a shape of integers, got: {term:?}")))?,
            _ => term.decode::<List<i64>>().map(|l| l.0).map_err(|_| {
                argument_error(format!("expected a shape (tuple or list of integers), got: {}", short(term)))
            })?,
        };
        if let Some(d) = dims.iter().find(|&&d| d < 0 || d > i32::MAX as i64) {
            return Err(argument_error(format!(
                "shape dimensions must be in 0..{}, got {d} in {term:?}",
                i32::MAX
            )));
        }
        Ok(Shape(dims))
    }
}

impl Shape {
    pub fn size(&self) -> Option<u64> {
        self.0.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
    }
}

/// A number: an integer, a float, `:nan`, `:infinity` or `:neg_infinity`.
pub struct Number(pub f64);

impl<'a> Decoder<'a> for Number {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        if let Ok(f) = term.decode::<f64>() {
            return Ok(Number(f));
        }
        if let Ok(i) = term.decode::<i64>() {
            return Ok(Number(i as f64));
        }
        if let Ok(a) = term.decode::<Atom>() {
            if a == atoms::nan() {
                return Ok(Number(f64::NAN));
            } else if a == atoms::infinity() {
                return Ok(Number(f64::INFINITY));
            } else if a == atoms::neg_infinity() {
                return Ok(Number(f64::NEG_INFINITY));
            }
        }
        Err(argument_error(format!("expected a number, :nan, :infinity or :neg_infinity, got: {term:?}")))
    }
}

/// A proper list. Use it instead of `Vec<T>` for list arguments: rustler's `Vec` decoder
/// panics on an improper list (`[1 | 2]`), which reaches Elixir as `:nif_panicked`
/// instead of an `ArgumentError`.
pub struct List<T>(pub Vec<T>);

impl<'a, T: Decoder<'a>> Decoder<'a> for List<T> {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        if term.list_length().is_err() {
            return Err(argument_error(format!("expected a proper list, got: {}", short(term))));
        }
        Ok(List(term.decode()?))
    }
}

/// `term` as errors show it, cut to a readable length.
pub fn short(term: Term) -> String {
    let s = format!("{term:?}");
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// A tensor or stream handle (a NIF resource). Decodes like `ResourceArc<R>`, but a term
/// that is not a live resource of this VM is refused with an `ArgumentError` naming the
/// cause: a handle sent to another node, or read back by `:erlang.binary_to_term/1` in
/// another VM, arrives as a plain reference with no array (or stream) behind it.
pub struct Live<R>(pub R);

impl<'a, R: rustler::Resource + 'a> Decoder<'a> for Live<rustler::ResourceArc<R>> {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        match term.decode::<rustler::ResourceArc<R>>() {
            Ok(r) => Ok(Live(r)),
            Err(_) => Err(argument_error(not_a_handle(term))),
        }
    }
}

/// Why `term` is not a tensor or stream handle.
pub fn not_a_handle(term: Term) -> String {
    if term.get_type() == TermType::Ref {
        format!(
            "{} is a reference but not an Emily tensor or stream of this VM: handles are \
             native resources, valid only in the VM that made them. One sent to another node \
             (a message, :erpc, Nx.Serving), or read back with :erlang.binary_to_term/1 in \
             another VM, has no array behind it. Send values instead: Nx.serialize/1 and \
             Nx.deserialize/1, or a copy on Nx.BinaryBackend",
            short(term)
        )
    } else {
        format!("expected an Emily tensor or stream handle, got: {}", short(term))
    }
}
