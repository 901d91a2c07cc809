defmodule Emily.Error do
  @moduledoc """
  Raised when MLX rejects an op. `message` names the op, the input shapes and dtypes, and
  MLX's own words; `op` is the op's name. The worker that raised it stays usable.
  """
  defexception [:message, :op]

  @type t :: %__MODULE__{message: String.t(), op: String.t()}
end
