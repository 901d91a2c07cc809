defmodule Emily.ObservabilityTest do
  use Emily.TestCase, async: false
  import ExUnit.CaptureLog

  require Emily.Telemetry
  require Emily.Debug

  describe "Emily.Telemetry" do
    test "enabled?/0 says whether :telemetry was there at compile time" do
      assert Emily.Telemetry.enabled?() == Code.ensure_loaded?(:telemetry)
    end

    test "the metadata and measurements of each event" do
      x = t([1.0, 2.0])
      assert Emily.Telemetry.eval_metadata([x, x, x]) == %{count: 3}
      assert Emily.Telemetry.to_binary_metadata(x) == %{tensor: x}
      assert Emily.Telemetry.to_binary_stop(<<0::64>>) == {%{bytes: 8}, %{}}

      assert Emily.Telemetry.fallback_metadata(:reduce, [{{3}, {:s, 32}}, {{}, {:s, 32}}]) ==
               %{op: :reduce, shapes: [{3}, {}], types: [{:s, 32}, {:s, 32}]}

      stats = Emily.Memory.stats()
      measurements = Emily.Telemetry.memory_measurements(Map.put(stats, :other, 1))

      assert Map.keys(measurements) |> Enum.sort() == [
               :active,
               :cache,
               :cache_limit,
               :memory_limit,
               :peak
             ]

      assert measurements.memory_limit == stats.memory_limit
    end

    if Code.ensure_loaded?(:telemetry) do
      test "eval, to_binary and memory stats emit their events" do
        parent = self()
        id = "emily-test-#{System.unique_integer()}"

        events = [
          [:emily, :eval, :start],
          [:emily, :eval, :stop],
          [:emily, :eval, :exception],
          [:emily, :to_binary, :stop],
          [:emily, :memory, :stats]
        ]

        :telemetry.attach_many(id, events, fn e, m, md, _ -> send(parent, {e, m, md}) end, nil)

        try do
          x = t([1.0, 2.0])
          Emily.eval([x, x])
          assert_receive {[:emily, :eval, :start], %{system_time: _}, %{count: 2}}
          assert_receive {[:emily, :eval, :stop], %{duration: _}, %{count: 2}}
          # A read that waits for the evaluation; none for an evaluated tensor.
          y = N.add(s(), x, x)
          Emily.to_binary(y)
          assert_receive {[:emily, :to_binary, :stop], %{duration: _, bytes: 8}, %{tensor: ^y}}
          Emily.to_binary(y)
          refute_received {[:emily, :to_binary, :stop], _, %{tensor: ^y}}
          Emily.Memory.stats()
          assert_receive {[:emily, :memory, :stats], %{active: _, memory_limit: _}, %{}}
          bad = N.reshape(s(), x, {3})
          assert_raise Emily.Error, fn -> Emily.eval(bad) end
          assert_receive {[:emily, :eval, :exception], %{duration: _}, %{kind: :error}}
        after
          :telemetry.detach(id)
        end
      end
    else
      test "without :telemetry, spans run their body and evaluate no metadata" do
        result =
          Emily.Telemetry.span :eval, raise("metadata must not be built") do
            :body
          end

        assert result == :body

        assert Emily.Telemetry.execute([:memory, :stats], raise("no"), raise("no")) == :ok
        # And the instrumented calls work as before.
        x = t([1.0])
        assert Emily.eval(x) == :ok
        assert Emily.to_binary(x) == <<1.0::float-32-native>>
      end
    end
  end

  describe "Emily.Fallback" do
    setup do
      previous = Map.new([:fallback, :warn_on_fallback], &{&1, Application.fetch_env(:emily, &1)})
      Emily.Fallback.reset()

      on_exit(fn ->
        for {key, value} <- previous do
          case value do
            {:ok, v} -> Application.put_env(:emily, key, v)
            :error -> Application.delete_env(:emily, key)
          end
        end
      end)
    end

    @inputs [{{3}, {:s, 32}}, {{}, {:s, 32}}]

    defp count(log, re), do: length(Regex.scan(re, log))

    test ":silent (the default) runs the fallback and logs nothing" do
      Application.delete_env(:emily, :fallback)
      Application.delete_env(:emily, :warn_on_fallback)
      assert Emily.Fallback.mode() == :silent

      log = capture_log(fn -> assert Emily.Fallback.span(:reduce, @inputs, fn -> 6 end) == 6 end)
      assert log == ""
    end

    test ":warn logs once per op and input types and shapes" do
      Application.put_env(:emily, :fallback, :warn)

      log =
        capture_log(fn ->
          for _ <- 1..3, do: assert(Emily.Fallback.span(:reduce, @inputs, fn -> :ran end) == :ran)
        end)

      assert count(log, ~r/reduce on s32\{3\}, s32\{\} falls back to Nx.BinaryBackend/) == 1

      # Another shape, or another op, warns again (once).
      log =
        capture_log(fn ->
          for _ <- 1..2 do
            Emily.Fallback.span(:reduce, [{{4}, {:s, 32}}], fn -> :ok end)
            Emily.Fallback.span(:window_reduce, @inputs, fn -> :ok end)
            Emily.Fallback.span(:reduce, @inputs, fn -> :ok end)
          end
        end)

      assert count(log, ~r/reduce on s32\{4\} falls back/) == 1
      assert count(log, ~r/window_reduce on s32\{3\}, s32\{\} falls back/) == 1
      assert count(log, ~r/ reduce on s32\{3\}/) == 0

      assert capture_log(fn -> Emily.Fallback.span(:iota, [], fn -> :ok end) end) =~
               "iota on no tensor inputs falls back"
    end

    test ":raise raises instead of running the fallback" do
      Application.put_env(:emily, :fallback, :raise)

      assert_raise ArgumentError,
                   "Emily.Backend has no native path for reduce on s32{3}, s32{} " <>
                     "(config :emily, :fallback is :raise)",
                   fn -> Emily.Fallback.span(:reduce, @inputs, fn -> flunk("ran") end) end
    end

    test "warn_on_fallback: true is read as :warn, with a deprecation warning, once" do
      Application.put_env(:emily, :fallback, :silent)
      Application.put_env(:emily, :warn_on_fallback, true)

      log =
        capture_log(fn ->
          assert Emily.Fallback.mode() == :warn
          for _ <- 1..3, do: Emily.Fallback.span(:reduce, @inputs, fn -> :ok end)
        end)

      assert count(log, ~r/warn_on_fallback: true is deprecated/) == 1
      assert count(log, ~r/falls back to Nx.BinaryBackend/) == 1

      # Both settings: one warning, in one wording.
      Emily.Fallback.reset()
      Application.put_env(:emily, :fallback, :warn)
      log = capture_log(fn -> Emily.Fallback.span(:reduce, @inputs, fn -> :ok end) end)
      assert count(log, ~r/\[warning\]/) == 1
      assert log =~ "reduce on s32{3}, s32{} falls back to Nx.BinaryBackend"

      # :raise wins over the old setting.
      Application.put_env(:emily, :fallback, :raise)
      assert Emily.Fallback.mode() == :raise
    end

    test "a :fallback setting that is none of the three is an error" do
      Application.put_env(:emily, :fallback, :loud)

      assert_raise ArgumentError, ~r/must be one of \[:silent, :warn, :raise\], got: :loud/, fn ->
        Emily.Fallback.span(:reduce, @inputs, fn -> :ok end)
      end
    end

    test "span/3 passes the fallback's exceptions on" do
      Application.put_env(:emily, :fallback, :silent)

      assert_raise RuntimeError, "inner", fn ->
        Emily.Fallback.span(:x, [], fn -> raise "inner" end)
      end
    end

    if Code.ensure_loaded?(:telemetry) do
      test "span/3 emits the [:emily, :fallback, *] span with op, shapes and types" do
        parent = self()
        id = "emily-fallback-#{System.unique_integer()}"
        events = for e <- [:start, :stop, :exception], do: [:emily, :fallback, e]
        :telemetry.attach_many(id, events, fn e, m, md, _ -> send(parent, {e, m, md}) end, nil)
        Application.put_env(:emily, :fallback, :silent)

        try do
          Emily.Fallback.span(:reduce, @inputs, fn -> :ok end)

          assert_receive {[:emily, :fallback, :start], %{system_time: _},
                          %{op: :reduce, shapes: [{3}, {}], types: [{:s, 32}, {:s, 32}]}}

          assert_receive {[:emily, :fallback, :stop], %{duration: _}, %{op: :reduce}}
          catch_error(Emily.Fallback.span(:x, [], fn -> raise "inner" end))
          assert_receive {[:emily, :fallback, :exception], _, %{op: :x, kind: :error}}
        after
          :telemetry.detach(id)
        end
      end
    end

    if Code.ensure_loaded?(Nx) do
      @tag :nx
      test "Emily.Backend's fallbacks go through it: one setting, one warning" do
        Application.put_env(:emily, :fallback, :warn)
        Application.put_env(:emily, :warn_on_fallback, true)
        # A reduce function that is not one op of its two arguments falls back.
        sum = &Nx.reduce(&1, 0, fn a, b -> Nx.max(Nx.add(a, b), 0) end)
        x = Nx.tensor([3, 1, 2], backend: Emily.Backend)

        log = capture_log(fn -> for _ <- 1..2, do: assert(Nx.to_number(sum.(x)) == 6) end)
        assert count(log, ~r/\[warning\]/) == 1
        assert log =~ "Emily.Backend: reduce on s32{3}, s32{} falls back to Nx.BinaryBackend"

        Application.put_env(:emily, :fallback, :raise)
        assert_raise ArgumentError, ~r/no native path for reduce on s32\{3\}/, fn -> sum.(x) end
      end
    end
  end

  describe "Emily.Debug" do
    # The flags are fixed at compile time (off unless EMILY_DEBUG names them, see
    # config/config.exs): each state gets the test it can run.
    if Emily.Debug.bounds_check?() do
      test "with :debug_bounds_check, check_bounds/4 checks" do
        assert Emily.Debug.check_bounds(s(), t([0, 1], {:s, 32}), 2, :take) == :ok

        assert_raise Emily.Error, ~r/take: 1 of the indices s32\[2\] are outside 0..1/, fn ->
          Emily.Debug.check_bounds(s(), t([0, 2], {:s, 32}), 2, :take)
        end
      end
    else
      test "without :debug_bounds_check (the default), check_bounds/4 evaluates nothing" do
        refute Emily.Debug.bounds_check?()
        assert Emily.Debug.check_bounds(raise("no"), raise("no"), raise("no"), :take) == :ok
      end
    end

    if Emily.Debug.detect_nan_inf?() do
      test "with :debug_detect_nan_inf, check_finite/3 checks" do
        assert Emily.Debug.check_finite(s(), t([1.0]), :matmul) == :ok

        assert_raise Emily.Error, ~r/matmul: 1 NaN or infinite values/, fn ->
          Emily.Debug.check_finite(s(), t([1.0, :nan]), :matmul)
        end
      end
    else
      test "without :debug_detect_nan_inf (the default), check_finite/3 evaluates nothing" do
        refute Emily.Debug.detect_nan_inf?()
        assert Emily.Debug.check_finite(raise("no"), raise("no"), :matmul) == :ok
      end
    end

    test "assert_in_bounds!/4 with one size per column checks each column against its own" do
      # {3, 2} indices into axes of 2 and 4: column 1 may hold 2 and 3, column 0 may not.
      assert Emily.Debug.assert_in_bounds!(
               s(),
               t([0, 3, 1, 2, 1, 0], {:s, 32}, {3, 2}),
               [2, 4],
               :gather
             ) ==
               :ok

      e =
        assert_raise Emily.Error, fn ->
          idx = t([2, 0, 1, 4, -1, -1, 1, 3], {:s, 64}, {4, 2})
          Emily.Debug.assert_in_bounds!(s(), idx, [2, 4], :indexed_add)
        end

      assert e.op == "indexed_add"

      assert e.message =~
               "indexed_add: 4 of the indices s64[4, 2] are outside their axes' ranges (0..1, 0..3)"

      # {2, 2, 1}: one column, for an axis of 3.
      assert_raise Emily.Error, ~r/1 of the indices u8\[2, 2, 1\]/, fn ->
        Emily.Debug.assert_in_bounds!(s(), t([0, 1, 2, 3], {:u, 8}, {2, 2, 1}), [3], :gather)
      end
    end

    test "scalar indices and scalar results are counted as numbers" do
      # (MLX's sum over a scalar keeps the bool of the comparison.)
      assert Emily.Debug.assert_in_bounds!(s(), t([1], {:s, 32}, {}), 2, :take) == :ok

      assert_raise Emily.Error, ~r/take: 1 of the indices s32\[\] are outside 0..1/, fn ->
        Emily.Debug.assert_in_bounds!(s(), t([2], {:s, 32}, {}), 2, :take)
      end

      with_cpu(fn ->
        assert Emily.Debug.assert_finite!(s(), t([1.0], {:f, 32}, {}), :dot) == :ok

        assert_raise Emily.Error, ~r/dot: 1 NaN or infinite values in a f32\[\] result/, fn ->
          Emily.Debug.assert_finite!(s(), t([:infinity], {:f, 32}, {}), :dot)
        end
      end)
    end

    test "assert_in_bounds!/4 accepts 0..size-1 and reports values outside, for every index type" do
      for type <- [{:s, 32}, {:s, 64}, {:u, 8}, {:u, 64}, {:s, 8}] do
        assert Emily.Debug.assert_in_bounds!(s(), t([0, 1, 2, 2], type), 3, :take) == :ok
      end

      e =
        assert_raise Emily.Error, fn ->
          Emily.Debug.assert_in_bounds!(s(), t([0, 3, -1, 2, 7], {:s, 32}), 3, :take)
        end

      assert e.op == "take"
      assert e.message =~ "3 of the indices s32[5] are outside 0..2"

      # u8 index 200 against an axis of 300: in bounds (no wrap-around in the check).
      assert Emily.Debug.assert_in_bounds!(s(), t([200, 299], {:u, 8}), 300, :gather) == :ok

      assert_raise Emily.Error, ~r/1 of the indices/, fn ->
        Emily.Debug.assert_in_bounds!(s(), t([0, 1], {:s, 32}), 1, :gather)
      end

      assert_raise Emily.Error, ~r/outside 0..-1/, fn ->
        Emily.Debug.assert_in_bounds!(s(), t([0], {:s, 32}), 0, :gather)
      end
    end

    test "assert_finite!/3 finds NaN and infinities in float results; integers pass" do
      with_cpu(fn ->
        assert Emily.Debug.assert_finite!(s(), t([1.0, -2.5, 0.0]), :matmul) == :ok
        assert Emily.Debug.assert_finite!(s(), t([1, 2], {:s, 32}), :matmul) == :ok
        assert Emily.Debug.assert_finite!(s(), t([true], :bool), :matmul) == :ok

        for dtype <- [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}] do
          e =
            assert_raise Emily.Error, fn ->
              Emily.Debug.assert_finite!(
                s(),
                t([1.0, :nan, :infinity, :neg_infinity], dtype),
                :rms_norm
              )
            end

          assert e.message =~ "rms_norm: 3 NaN or infinite values"
        end

        # A list of tensors, and a lazy result (1 / 0).
        inf = N.divide(s(), t([1.0]), t([0.0]))

        assert_raise Emily.Error, ~r/1 NaN or infinite/, fn ->
          Emily.Debug.assert_finite!(s(), [t([1.0]), inf], :eval)
        end
      end)
    end
  end
end
