//! Errors that cross the NIF boundary. `Error` is what workers produce; it reaches Elixir
//! as an `Emily.Error` exception (or `ArgumentError` for bad arguments from Elixir).
use rustler::NifException;

/// `%Emily.Error{}` in Elixir.
#[derive(Debug, Clone, NifException)]
#[module = "Emily.Error"]
pub struct ExError {
    pub message: String,
    pub op: String,
}

/// `%ArgumentError{}` in Elixir.
#[derive(Debug, NifException)]
#[module = "ArgumentError"]
pub struct ExArgumentError {
    pub message: String,
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// MLX threw while building or evaluating `op` on inputs described by `inputs`.
    #[error("{op}: {message} (inputs: {inputs})")]
    Mlx { op: String, message: String, inputs: String },
    /// A tensor this op needs failed earlier; the original error is carried along.
    #[error("{op}: an input failed earlier: {source}")]
    Input { op: String, source: Box<Error> },
    /// The tensor was released (`tensor_release`), so its array is gone.
    #[error("{op}: tensor {id} has been released")]
    Released { op: String, id: u64 },
}

impl Error {
    pub fn op(&self) -> &str {
        match self {
            Error::Mlx { op, .. } | Error::Input { op, .. } | Error::Released { op, .. } => op,
        }
    }

    pub fn to_exception(&self) -> ExError {
        ExError { message: self.to_string(), op: self.op().to_string() }
    }
}

/// Describes inputs the way errors name them: `f32[2x3], s32[]`.
pub fn describe(inputs: &[(Vec<i32>, String)]) -> String {
    if inputs.is_empty() {
        return "none".into();
    }
    inputs
        .iter()
        .map(|(shape, dt)| {
            let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
            format!("{dt}[{}]", dims.join("x"))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A `rustler::Error` that raises `ArgumentError` with `message`.
pub fn argument_error(message: impl Into<String>) -> rustler::Error {
    rustler::Error::RaiseTerm(Box::new(ExArgumentError { message: message.into() }))
}

pub fn raise(e: &Error) -> rustler::Error {
    rustler::Error::RaiseTerm(Box::new(e.to_exception()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_op_shapes_and_dtypes() {
        let e = Error::Mlx {
            op: "add".into(),
            message: "Shapes (2,3) and (4) cannot be broadcast.".into(),
            inputs: describe(&[(vec![2, 3], "f32".into()), (vec![4], "s32".into())]),
        };
        assert_eq!(
            e.to_string(),
            "add: Shapes (2,3) and (4) cannot be broadcast. (inputs: f32[2x3], s32[4])"
        );
        let chained = Error::Input { op: "exp".into(), source: Box::new(e) };
        assert!(chained.to_string().starts_with("exp: an input failed earlier: add: Shapes"));
        assert_eq!(chained.op(), "exp");
        assert_eq!(describe(&[(vec![], "f32".into())]), "f32[]");
        assert_eq!(describe(&[]), "none");
    }
}
