defmodule Emily.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    # Before anything reaches MLX: its compiled kernels go to a folder only this user
    # can write to (Emily.KernelCache), or Emily does not start.
    case Emily.KernelCache.setup() do
      :ok ->
        Supervisor.start_link([Emily.Stream.Defaults],
          strategy: :one_for_one,
          name: Emily.Supervisor
        )

      {:error, message} ->
        raise message
    end
  end
end
