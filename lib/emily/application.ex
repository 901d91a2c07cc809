defmodule Emily.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    Supervisor.start_link([Emily.Stream.Defaults], strategy: :one_for_one, name: Emily.Supervisor)
  end
end
