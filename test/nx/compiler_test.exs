# Emily.Compiler: defn functions through the evaluator path against Nx.Defn.Evaluator on
# Nx.BinaryBackend, grad against finite differences, hooks (as each Nx release writes
# them: Emily.NxHooks), control flow, options and partitions.
if Code.ensure_loaded?(Nx) do
  defmodule Emily.Nx.CompilerTest do
    use ExUnit.Case, async: true
    @moduletag :nx

    import Nx.Defn
    import Emily.NxOracle
    import Emily.NxCompiler
    alias Emily.NxOracle, as: O

    import Emily.NxModels

    defn layer_norm(x) do
      mean = Nx.mean(x, axes: [-1], keep_axes: true)
      var = Nx.variance(x, axes: [-1], keep_axes: true)
      (x - mean) / Nx.sqrt(var + 1.0e-5)
    end

    defn branch(x) do
      cond do
        Nx.sum(x) > 1 -> x * 2
        Nx.sum(x) < -1 -> x - 3
        true -> Nx.cos(x)
      end
    end

    alias Emily.NxHooks

    defn(doubled(x), do: x |> Nx.multiply(2) |> NxHooks.named(:double) |> Nx.add(1))

    defn(printed(x), do: x |> Nx.add(1) |> print_value(label: "value") |> Nx.multiply(3))

    # Doubles until above 10, reporting each pass's value.
    defn stepped(x) do
      while x, x < 10 do
        NxHooks.named(x * 2, :step)
      end
    end

    defn(doubled_if_positive(x), do: if(Nx.sum(x) > 0, do: doubled(x), else: x))

    # A hook outside the conditionals that read it: it runs once, whichever branches.
    defn doubled_in_branches(x) do
      d = doubled(x)
      left = if Nx.sum(x) > 0, do: d, else: -d
      right = if Nx.sum(x) > 0, do: d * 2, else: d
      left * right
    end

    defn counted(x, opts \\ []) do
      opts = keyword!(opts, [:pid])
      y = x + 1
      y = Nx.runtime_call(y, y, [pid: opts[:pid]], &report/2)
      y * 2
    end

    def report(t, opts) do
      send(opts[:pid], {:runtime_call, t})
      t
    end

    # Nx 0.12's and 0.13's tokens: hooks on values the result does not hold (as
    # Bumblebee's generation streams its tokens), run in the order they were declared.
    if NxHooks.tokens?() do
      defn tokened(x) do
        token = NxHooks.create_token()
        {token, _} = NxHooks.hook_token(token, x * 2, :double)
        {token, y} = NxHooks.hook_token(token, x + 1, :plus_one)
        NxHooks.attach_token(token, {y * 3, x - 1})
      end

      # Passes until above 10, reporting each pass's state and its double.
      defn tokened_loop(x) do
        while {x, i = 0}, x < 10 do
          token = NxHooks.create_token()
          {token, _} = NxHooks.hook_token(token, %{value: x * 2, pass: i}, :step)
          NxHooks.attach_token(token, {x * 2, i + 1})
        end
      end
    end

    # A hook watching a doubling chain (a DAG of 16 nodes, 2^16 paths), as Bumblebee's
    # generation watches each token, which the whole model computes: with a token where
    # this Nx has them (0.13's evaluator keeps a token hook's watched graph whole).
    if NxHooks.tokens?() do
      defn watched_chain(x) do
        token = NxHooks.create_token()
        {token, _} = NxHooks.hook_token(token, chain(x), :watch)
        NxHooks.attach_token(token, x + 1)
      end
    else
      defn(watched_chain(x),
        do: x |> chain() |> NxHooks.named(:watch) |> Nx.multiply(0) |> Nx.add(x + 1)
      )
    end

    deftransformp(chain(x), do: Enum.reduce(1..16, x, fn _, acc -> Nx.add(acc, acc) end))

    defn scan_stats(x) do
      {Nx.cumulative_sum(x, axis: 1), Nx.argmax(x, axis: 1), Nx.sort(x, axis: 1)}
    end

    defp check_defn(fun, args, opts \\ []) do
      expected =
        Nx.with_default_backend(Nx.BinaryBackend, fn ->
          apply(Nx.Defn.jit(fun, compiler: Nx.Defn.Evaluator), args)
        end)

      actual = apply(ejit(fun, native: false), args)
      assert_same(actual, expected, opts)
      actual
    end

    describe "evaluator path" do
      test "agrees with Nx.BinaryBackend" do
        x = O.tensor({4, 6}, {:f, 32})

        params =
          {O.tensor({6, 5}, {:f, 32}), O.tensor({5}, {:f, 32}), O.tensor({5, 3}, {:f, 32}),
           O.tensor({3}, {:f, 32})}

        check_defn(&softmax/1, [x])
        check_defn(&mlp/2, [x, params])

        check_defn(&attention/3, [
          O.tensor({2, 4, 3}, {:f, 32}),
          O.tensor({2, 5, 3}, {:f, 32}),
          O.tensor({2, 5, 3}, {:f, 32})
        ])

        check_defn(&layer_norm/1, [x], tol: {1.0e-4, 1.0e-4})
        check_defn(&powers/1, [O.tensor({3}, {:f, 32}, :unit)])
        check_defn(&scan_stats/1, [O.tensor({3, 4}, {:s, 32}, :small)])

        for x <- [Nx.tensor([1.0, 2.0]), Nx.tensor([-1.0, -2.0]), Nx.tensor([0.1, 0.2])] do
          check_defn(&branch/1, [Nx.backend_copy(x, Nx.BinaryBackend)])
        end
      end

      test "results are Emily tensors; other backends' inputs are copied in" do
        for native <- [false, true] do
          jit = ejit(&softmax/1, native: native)
          out = jit.(Nx.iota({2, 3}, type: :f32, backend: Nx.BinaryBackend))
          assert %Emily.Backend{} = out.data

          emily_in = emily(Nx.iota({2, 3}, type: :f32, backend: Nx.BinaryBackend))
          assert %Emily.Backend{} = jit.(emily_in).data
        end
      end

      test "Nx.Defn.compile and default options" do
        template = Nx.template({2, 3}, {:f, 32})

        compiled =
          Nx.Defn.compile(&softmax/1, [template], compiler: Emily.Compiler, native: false)

        x = O.tensor({2, 3}, {:f, 32})
        assert_same(compiled.(x), Nx.with_default_backend(Nx.BinaryBackend, fn -> softmax(x) end))

        previous = Nx.Defn.default_options(compiler: Emily.Compiler)

        try do
          assert %Emily.Backend{} = softmax(x).data
        after
          Nx.Defn.default_options(previous)
        end
      end
    end

    describe "grad" do
      defn(f_sin(x), do: Nx.sum(Nx.sin(x) * x))
      defn(f_logsumexp(x), do: Nx.log(Nx.sum(Nx.exp(x))))
      defn(f_sigmoid(x), do: Nx.sum(Nx.sigmoid(x) ** 2 / (1 + x * x)))
      defn(f_norm(x), do: Nx.sqrt(Nx.sum(x * x)) + Nx.reduce_max(x))

      defn f_mlp(w, x, y) do
        pred = Nx.tanh(Nx.dot(x, w))
        Nx.mean((pred - y) ** 2)
      end

      defn f_softmax_ce(w, x) do
        p = softmax(Nx.dot(x, w))
        -Nx.sum(Nx.log(p[[.., 0]]))
      end

      test "matches central finite differences" do
        x = O.tensor({5}, {:f, 32})
        mx = O.tensor({4, 3}, {:f, 32})
        w = O.tensor({3, 2}, {:f, 32}, :unit)
        y = O.tensor({4, 2}, {:f, 32}, :unit)

        for {f, args} <- [
              {&f_sin/1, [x]},
              {&f_logsumexp/1, [x]},
              {&f_sigmoid/1, [x]},
              {&f_norm/1, [x]},
              {&f_mlp/3, [w, mx, y]},
              {&f_softmax_ce/2, [w, mx]}
            ] do
          [p | rest] = args
          fd = finite_differences(f, p, rest)

          for native <- [false, true] do
            g = ejit(fn p -> grad(p, &apply(f, [&1 | rest])) end, native: native).(p)
            assert %Emily.Backend{} = g.data
            assert_same(g, fd, tol: {2.0e-3, 2.0e-3})
          end
        end
      end
    end

    # d f / d p_i ~ (f(p + h e_i) - f(p - h e_i)) / 2h, evaluated in f64 on BinaryBackend.
    defp finite_differences(f, p, rest) do
      Nx.with_default_backend(Nx.BinaryBackend, fn ->
        h = 1.0e-5
        p64 = Nx.as_type(p, :f64)
        rest64 = Enum.map(rest, &Nx.as_type(&1, :f64))
        flat = Nx.to_flat_list(p64)

        grads =
          for i <- 0..(length(flat) - 1) do
            at = fn delta ->
              shifted =
                flat
                |> List.update_at(i, &(&1 + delta))
                |> Nx.tensor(type: :f64)
                |> Nx.reshape(p.shape)

              Nx.to_number(apply(f, [shifted | rest64]))
            end

            (at.(h) - at.(-h)) / (2 * h)
          end

        grads |> Nx.tensor(type: :f32) |> Nx.reshape(p.shape)
      end)
    end

    describe "io_calls, print_value and runtime_call" do
      # On the evaluator path and on the native path (where the call runs on the host,
      # between the programs before and after it).
      defp both_paths(fun) do
        for native <- [false, true] do
          {out, fallbacks} = with_fallbacks(fn -> fun.(native: native) end)
          assert debug_fallbacks?(fallbacks)
          out
        end
      end

      test "named io_calls run the :hooks given at jit time" do
        pid = self()
        x = Nx.tensor([1.0, 2.0], backend: Nx.BinaryBackend)

        both_paths(fn opts ->
          out = ejit(&doubled/1, [hooks: %{double: &send(pid, {:double, &1})}] ++ opts).(x)
          assert Nx.to_flat_list(out) == [3.0, 5.0]
          assert_receive {:double, doubled}
          assert %Emily.Backend{} = doubled.data
          assert Nx.to_flat_list(doubled) == [2.0, 4.0]

          # Without a hook the io_call is a no-op.
          assert Nx.to_flat_list(ejit(&doubled/1, opts).(x)) == [3.0, 5.0]
          refute_receive {:double, _}
        end)
      end

      test "print_value prints the value" do
        both_paths(fn opts ->
          out =
            ExUnit.CaptureIO.capture_io(fn ->
              assert Nx.to_flat_list(ejit(&printed/1, opts).(Nx.tensor([1, 2]))) == [6, 9]
            end)

          assert out =~ "value"
          assert out =~ "[2, 3]"
        end)
      end

      test "runtime_call calls back into Elixir with Emily tensors" do
        pid = self()

        both_paths(fn opts ->
          out = ejit(&counted(&1, pid: pid), opts).(Nx.tensor([1, 2, 3]))
          assert Nx.to_flat_list(out) == [4, 6, 8]
          assert_receive {:runtime_call, t}
          assert %Emily.Backend{} = t.data
          assert Nx.to_flat_list(t) == [2, 3, 4]
        end)
      end

      test "an io_call in a loop runs on every pass, on the native path too" do
        pid = self()
        hooks = %{step: &send(pid, {:step, Nx.to_number(&1)})}

        both_paths(fn opts ->
          out = ejit(&stepped/1, [hooks: hooks] ++ opts).(Nx.tensor(1.0))
          assert Nx.to_number(out) == 16.0
          for v <- [2.0, 4.0, 8.0, 16.0], do: assert_receive({:step, ^v})
          refute_receive {:step, _}
        end)
      end

      test "a hook with no callback is its data: nothing runs on the host" do
        x = Nx.tensor([1.0, 2.0])
        # (The lowering raises at a host step: here there is none.)
        assert {_, _, [_], _, _} = Emily.Compiler.Native.instructions_of(&doubled/1, [x])

        both_paths(fn opts ->
          assert Nx.to_flat_list(ejit(&doubled/1, opts).(x)) == [3.0, 5.0]
        end)
      end

      if NxHooks.tokens?() do
        test "tokens run their hooks in order, on values the result does not hold" do
          pid = self()

          hooks = %{
            double: &send(pid, {:double, Nx.to_flat_list(&1)}),
            plus_one: &send(pid, {:plus_one, Nx.to_flat_list(&1)})
          }

          both_paths(fn opts ->
            {y, z} = ejit(&tokened/1, [hooks: hooks] ++ opts).(Nx.tensor([1.0, 2.0]))
            assert Nx.to_flat_list(y) == [6.0, 9.0]
            assert Nx.to_flat_list(z) == [0.0, 1.0]
            assert_receive {first, value} when first in [:double, :plus_one]
            assert {first, value} == {:double, [2.0, 4.0]}
            assert_received {:plus_one, [2.0, 3.0]}

            # Without callbacks the tokens are inert.
            {y, _} = ejit(&tokened/1, opts).(Nx.tensor([1.0, 2.0]))
            assert Nx.to_flat_list(y) == [6.0, 9.0]
            refute_receive {:double, _}
            refute_received {:plus_one, _}
          end)
        end

        test "a token in a loop whose condition reads an input runs on every pass" do
          pid = self()

          hooks = %{
            step: fn %{value: v, pass: i} ->
              send(pid, {:step, Nx.to_number(i), Nx.to_number(v)})
            end
          }

          both_paths(fn opts ->
            {x, i} = ejit(&tokened_loop/1, [hooks: hooks] ++ opts).(Nx.tensor(1.5))
            assert {Nx.to_number(x), Nx.to_number(i)} == {12.0, 3}
            for {i, v} <- [{0, 3.0}, {1, 6.0}, {2, 12.0}], do: assert_receive({:step, ^i, ^v})
            refute_receive {:step, _, _}
          end)
        end
      end

      test "an io_call outside the branches that read it runs once" do
        hooked_runs(&doubled_in_branches/1, [{1.0, 18.0, 2.0}, {-1.0, -1.0, -2.0}])
      end

      test "an io_call in a branch runs when the branch is taken" do
        hooked_runs(&doubled_if_positive/1, [{1.0, 3.0, 2.0}, {-1.0, -1.0, nil}])
      end

      # `fun` on each path, for each `{x, result, hooked}`: its result on `[x]`, and the
      # value its `:double` hook received, once (nil: it did not run).
      defp hooked_runs(fun, cases) do
        pid = self()
        hooks = %{double: &send(pid, {:double, Nx.to_flat_list(&1)})}

        both_paths(fn opts ->
          jit = ejit(fun, [hooks: hooks] ++ opts)

          for {x, expected, hooked} <- cases do
            assert Nx.to_flat_list(jit.(Nx.tensor([x]))) == [expected]
            if hooked, do: assert_receive({:double, [^hooked]})
            refute_received {:double, _}
          end
        end)
      end
    end

    defp doubling(x, depth), do: Enum.reduce(1..depth, x, fn _, acc -> Nx.add(acc, acc) end)

    describe "graphs with much sharing" do
      # Each node of a DAG is visited once: a doubling chain of depth n has n nodes and
      # 2^n paths. A closure over a traced graph is the compiler's cache key (as
      # Nx.Defn.Graph.run/2 jits each stage). A walk of each path would take seconds at
      # depth 22 (so the bound, generous, fails first) and never end at 60, in a call the
      # VM cannot interrupt.
      test "a closure over a traced doubling chain, jitted again and again" do
        x = Nx.tensor([1.0, 2.0])

        for depth <- [22, 60] do
          expr = Nx.Defn.debug_expr(&doubling(&1, depth)).(x)
          expected = Nx.to_flat_list(Nx.multiply(x, 2.0 ** depth))

          {us, _} =
            :timer.tc(fn ->
              for opts <- [[], [native: false]], _ <- 1..3 do
                assert Nx.to_flat_list(ejit(fn _ -> expr end, opts).(x)) == expected
              end
            end)

          assert us < 5_000_000, "depth #{depth}: #{div(us, 1000)} ms"
        end
      end

      if Version.match?(to_string(Application.spec(:nx, :vsn)), "< 0.13.0") do
        @tag skip:
               "Nx 0.12's Nx.Defn.Graph.split/2 itself walks each path of a DAG " <>
                 "(exponential in its depth, whatever the compiler); Nx 0.13 memoises it"
      end

      test "Nx.Defn.Graph.split/2 and run/2 over a doubling chain" do
        x = Nx.tensor([1.0, 2.0])

        for depth <- [22, 60], opts <- [[], [native: false]] do
          Nx.Defn.default_options([compiler: Emily.Compiler] ++ opts)
          expr = Nx.Defn.debug_expr(&doubling(&1, depth)).(x)
          stages = Nx.Defn.Graph.split(expr, fn _ -> :none end)
          {us, out} = :timer.tc(fn -> Nx.Defn.Graph.run(stages, [x]) end)
          assert Nx.to_flat_list(out) == Nx.to_flat_list(Nx.multiply(x, 2.0 ** depth))
          assert us < 5_000_000, "depth #{depth}: #{div(us, 1000)} ms"
        end
      end

      test "a jit of Nx.LinAlg.eigh, whose default is a DAG that flattens to some 100 GB" do
        a = Nx.tensor([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]])

        expected =
          Nx.with_default_backend(Nx.BinaryBackend, fn -> Nx.LinAlg.eigh(a) |> elem(0) end)

        for opts <- [[], [native: true]] do
          values = ejit(&(Nx.LinAlg.eigh(&1) |> elem(0)), opts).(a)
          assert_same(values, expected, tol: {1.0e-4, 1.0e-4})
        end
      end
    end

    describe "options" do
      test "unknown options are accepted and passed through" do
        x = O.tensor({2, 3}, {:f, 32})
        out = ejit(&softmax/1, axon_mode: :inference, garbage_collect: true, foo: [bar: 1]).(x)
        assert_same(out, Nx.with_default_backend(Nx.BinaryBackend, fn -> softmax(x) end))
      end

      test ":device and :stream choose where the work runs" do
        s = Emily.Stream.new(:cpu)
        out = ejit(&softmax/1, stream: s).(Nx.iota({2, 2}, type: :f32, backend: Nx.BinaryBackend))
        assert out.data.stream == s
        out = ejit(&softmax/1, device: :cpu).(Nx.iota({2, 2}, type: :f32))
        assert Emily.Stream.device(out.data.stream) == :cpu

        # An input still lazy on another stream is evaluated there, then used here.
        other = Emily.Stream.new(:cpu)
        lazy = Emily.Stream.with_stream(other, fn -> Nx.multiply(Nx.iota({2}, type: :f32), 0) end)
        out = ejit(&softmax/1, stream: s).(lazy)
        assert out.data.stream == s
        assert Nx.to_flat_list(out) == [0.5, 0.5]
      end

      test "__partitions_options__ gives each partition its own stream" do
        parts = Emily.Compiler.__partitions_options__(max_concurrency: 3, foo: 1)
        assert length(parts) == 3
        streams = Enum.map(parts, & &1[:stream])
        assert length(Enum.uniq(streams)) == 3
        assert Enum.all?(parts, &(&1[:foo] == 1))

        for opts <- parts do
          out =
            Nx.Defn.jit(&softmax/1, [compiler: Emily.Compiler] ++ opts).(Nx.tensor([1.0, 2.0]))

          assert out.data.stream == opts[:stream]
        end

        assert [_] = Emily.Compiler.__partitions_options__([])
      end

      test "__to_backend__" do
        assert Emily.Compiler.__to_backend__([]) == {Emily.Backend, []}
        assert Emily.Compiler.__to_backend__(device: :cpu) == {Emily.Backend, [device: :cpu]}

        assert Emily.Compiler.__to_backend__(stream: Emily.Stream.new(:cpu)) ==
                 {Emily.Backend, [device: :cpu]}

        assert Nx.Defn.to_backend(compiler: Emily.Compiler) == {Emily.Backend, []}
      end

      test "a lazy container's values the graph does not read are not asked for" do
        # (Asking for :b raises, as Nx's lazy_container_test checks of Nx.Defn.Evaluator.)
        for opts <- [[], [native: false]] do
          {out, fallbacks} =
            with_fallbacks(fn ->
              fun = ejit(fn %Emily.NxLazy.Wrapped{a: a, c: c} -> Nx.add(a, c) end, opts)
              fun.(%Emily.NxLazy{a: 1, b: 2, c: 3})
            end)

          assert Nx.to_number(out) == 4
          assert fallbacks == []
        end
      end

      test "the native path runs graphs it cannot lower on the evaluator path and reports it" do
        {out, fallbacks} = with_fallbacks(fn -> ejit(&odd_fold/1).(Nx.tensor([1, 2])) end)
        assert Nx.to_number(out) == 4
        assert [%{reason: {:reduce, :function}}] = fallbacks
      end
    end

    describe "compiled functions sent to other processes" do
      # Nx.Serving runs each batch in a task, so the compiled function is copied there, and
      # a copy flattens a DAG: a function that held the traced chain would copy as its
      # 2^16 paths (millions of words; Bumblebee's generation, tens of gigabytes).
      test "hold no traced graph, and run (and call their hooks) in the other process" do
        x = Nx.tensor([1.0, 2.0])
        pid = self()
        hooks = %{watch: &send(pid, {:watch, Nx.to_flat_list(&1)})}

        for opts <- [[], [native: false]] do
          compiled =
            Nx.Defn.compile(&watched_chain/1, [Nx.template({2}, :f32)],
              compiler: Emily.Compiler,
              hooks: hooks,
              native: Keyword.get(opts, :native, true)
            )

          words = :erts_debug.flat_size(compiled)
          assert words < 20_000, "#{inspect(opts)}: #{words} words"

          out = Task.async(fn -> Nx.to_flat_list(compiled.(x)) end) |> Task.await()
          assert out == [2.0, 3.0]
          assert_receive {:watch, [65536.0, 131_072.0]}
        end
      end
    end
  end
else
  defmodule Emily.Nx.CompilerTest do
    use ExUnit.Case, async: true
    @moduletag :nx
    require Emily.NxAbsent
    Emily.NxAbsent.placeholders()
  end
end
