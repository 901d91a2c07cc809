//! MLX dtypes and their Nx names. The table below mirrors `mlx::core::Dtype::Val`
//! (mlx/dtype.h), in its order; nothing else in the crate or in C++ lists dtypes.
use crate::error::argument_error;
use rustler::{Atom, Decoder, Encoder, Env, NifResult, Term};

mod atoms {
    rustler::atoms! { bool, u, s, f, bf, c }
}

/// One MLX dtype: its `Dtype::Val` code, byte size, and Nx name (`{kind, bits}`, or
/// `:bool` for MLX's bool, which Nx lacks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DType {
    pub val: u8,
    pub size: u8,
    pub kind: &'static str,
    pub bits: u16,
}

const fn d(val: u8, kind: &'static str, bits: u16) -> DType {
    DType { val, size: if bits < 8 { 1 } else { (bits / 8) as u8 }, kind, bits }
}

/// Every MLX dtype, indexed by `Dtype::Val`.
pub const DTYPES: [DType; 14] = [
    d(0, "bool", 8),
    d(1, "u", 8),
    d(2, "u", 16),
    d(3, "u", 32),
    d(4, "u", 64),
    d(5, "s", 8),
    d(6, "s", 16),
    d(7, "s", 32),
    d(8, "s", 64),
    d(9, "f", 16),
    d(10, "f", 32),
    d(11, "f", 64),
    d(12, "bf", 16),
    d(13, "c", 64),
];

impl DType {
    pub fn from_val(val: u8) -> Option<DType> {
        DTYPES.get(val as usize).copied()
    }

    pub fn from_name(kind: &str, bits: u16) -> Option<DType> {
        DTYPES.iter().copied().find(|t| t.kind == kind && (t.kind == "bool" || t.bits == bits))
    }

    /// `f32`, `bf16`, `bool`: how errors name a dtype.
    pub fn short_name(&self) -> String {
        if self.kind == "bool" {
            "bool".into()
        } else {
            format!("{}{}", self.kind, self.bits)
        }
    }
}

impl<'a> Decoder<'a> for DType {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        if let Ok(a) = term.decode::<Atom>() {
            if a == atoms::bool() {
                return Ok(DTYPES[0]);
            }
        } else if let Ok((k, bits)) = term.decode::<(Atom, u16)>() {
            let kind = k.to_term(term.get_env()).atom_to_string()?;
            if kind != "bool" {
                if let Some(t) = DType::from_name(&kind, bits) {
                    return Ok(t);
                }
            }
        }
        Err(argument_error(format!(
            "unknown dtype {term:?}; expected :bool, {{:u, 8|16|32|64}}, {{:s, 8|16|32|64}}, {{:f, 16|32|64}}, {{:bf, 16}} or {{:c, 64}}"
        )))
    }
}

impl Encoder for DType {
    fn encode<'a>(&self, env: Env<'a>) -> Term<'a> {
        let kind = match self.kind {
            "bool" => return atoms::bool().encode(env),
            "u" => atoms::u(),
            "s" => atoms::s(),
            "f" => atoms::f(),
            "bf" => atoms::bf(),
            _ => atoms::c(),
        };
        (kind, self.bits).encode(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_indexed_by_val() {
        for (i, t) in DTYPES.iter().enumerate() {
            assert_eq!(t.val as usize, i);
        }
    }

    #[test]
    fn names_round_trip() {
        for t in DTYPES {
            assert_eq!(DType::from_name(t.kind, t.bits), Some(t));
        }
        assert_eq!(DType::from_name("f", 8), None);
        assert_eq!(DType::from_name("c", 128), None);
        assert_eq!(DType::from_val(10).unwrap().short_name(), "f32");
        assert_eq!(DType::from_val(12).unwrap().size, 2);
    }
}
