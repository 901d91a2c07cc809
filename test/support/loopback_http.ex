defmodule Emily.LoopbackHTTP do
  @moduledoc """
  A minimal HTTP/1.1 server on 127.0.0.1 for the install tests: each path answers what
  `set/3` says, and every request is counted.

  Answers: `{:file, path}`, `{:body, binary}`, `{:status, code}`, or
  `{:truncate, binary, bytes}` (declares the whole length, sends `bytes` of it, closes).
  Unknown paths answer 404.
  """

  def start do
    {:ok, listen} =
      :gen_tcp.listen(0, [
        :binary,
        ip: {127, 0, 0, 1},
        active: false,
        packet: :http_bin,
        reuseaddr: true
      ])

    {:ok, port} = :inet.port(listen)
    {:ok, state} = Agent.start(fn -> %{routes: %{}, hits: %{}} end)
    acceptor = spawn(fn -> accept(listen, state) end)
    :ok = :gen_tcp.controlling_process(listen, acceptor)

    %{
      port: port,
      url: "http://127.0.0.1:#{port}",
      state: state,
      acceptor: acceptor,
      listen: listen
    }
  end

  def stop(server) do
    Process.exit(server.acceptor, :kill)
    :gen_tcp.close(server.listen)
    if Process.alive?(server.state), do: Agent.stop(server.state)
    :ok
  end

  def set(server, path, answer),
    do: Agent.update(server.state, &put_in(&1, [:routes, path], answer))

  def hits(server, path), do: Agent.get(server.state, &Map.get(&1.hits, path, 0))

  defp accept(listen, state) do
    case :gen_tcp.accept(listen) do
      {:ok, sock} ->
        pid = spawn(fn -> serve(sock, state) end)
        :gen_tcp.controlling_process(sock, pid)
        send(pid, :go)
        accept(listen, state)

      {:error, _} ->
        :ok
    end
  end

  defp serve(sock, state) do
    receive do
      :go -> :ok
    end

    with {:ok, {:http_request, _method, {:abs_path, path}, _}} <- :gen_tcp.recv(sock, 0, 5000),
         :ok <- skip_headers(sock) do
      answer =
        Agent.get_and_update(state, fn s ->
          {Map.get(s.routes, path, {:status, 404}), update_in(s.hits[path], &((&1 || 0) + 1))}
        end)

      :ok = :inet.setopts(sock, packet: :raw)
      respond(sock, answer)
    end

    :gen_tcp.close(sock)
  end

  defp skip_headers(sock) do
    case :gen_tcp.recv(sock, 0, 5000) do
      {:ok, :http_eoh} -> :ok
      {:ok, {:http_header, _, _, _, _}} -> skip_headers(sock)
      other -> other
    end
  end

  defp respond(sock, {:file, path}), do: respond(sock, {:body, File.read!(path)})
  defp respond(sock, {:body, body}), do: send_response(sock, 200, byte_size(body), body)

  defp respond(sock, {:status, code}),
    do: send_response(sock, code, byte_size("no\n"), "no\n")

  defp respond(sock, {:truncate, body, bytes}),
    do: send_response(sock, 200, byte_size(body), binary_part(body, 0, bytes))

  defp send_response(sock, code, length, body) do
    :gen_tcp.send(sock, [
      "HTTP/1.1 #{code} X\r\ncontent-type: application/octet-stream\r\n",
      "content-length: #{length}\r\nconnection: close\r\n\r\n",
      body
    ])
  end
end
