defmodule Emily.Native.FixturesTest do
  @moduledoc false
  # The property suite of the numeric families: every case in test/fixtures/*.fixtures
  # (written by scripts/fixtures.py from NumPy/SciPy, see its header for the format) is
  # replayed through Emily.Native and compared with the reference.
  use Emily.TestCase, async: true

  @dir Path.expand("../fixtures", __DIR__)

  # Tolerance per output dtype: |actual - expected| <= rtol * |expected| + atol, against
  # the reference rounded to the output dtype (ulp at 1.0: f32 1.2e-7, f16 9.8e-4, bf16
  # 7.8e-3). NaN must be NaN and infinities exact; integers and bools must match exactly.
  #
  #   elementwise ops     f32 2e-6 / 1e-6     f16 2e-3 / 1e-3    bf16 1.6e-2 / 1.6e-2
  #   accumulating ops    f32 4e-6 / 2e-6     f16 4e-3 / 4e-3    bf16 3.2e-2 / 3.2e-2
  #   erf, erfc (f32)     1e-5 / 1e-6
  #
  # Accumulating ops are the reductions and scans other than max/min: MLX accumulates f16
  # and bf16 in their own precision where the reference is exact. erf is MLX's polynomial;
  # erfc's float32 tail (x > 4) inherits MLX's exp error at large arguments (~|x^2| * 3e-8
  # relative, so up to ~5e-6 near x = 9).
  @elementwise %{
    {:f, 32} => {2.0e-6, 1.0e-6},
    {:f, 16} => {2.0e-3, 1.0e-3},
    {:bf, 16} => {1.6e-2, 1.6e-2}
  }
  @accumulating %{
    {:f, 32} => {4.0e-6, 2.0e-6},
    {:f, 16} => {4.0e-3, 4.0e-3},
    {:bf, 16} => {3.2e-2, 3.2e-2}
  }
  @approximate %{{:f, 32} => {1.0e-5, 1.0e-6}}
  @approximate_ops [:erf, :erfc]

  for family <- ~w(unary binary reduce scan sort) do
    @family family
    # A GPU build compiles a kernel for each new shape (NVRTC): far slower the first time.
    @tag timeout: 600_000
    test "#{family} ops match the NumPy/SciPy fixtures" do
      cases = read_cases(Path.join(@dir, "#{@family}.fixtures"))
      assert length(cases) > 50

      failures =
        for c <- cases, msg = check(c), msg != nil, do: msg

      assert failures == [],
             "#{length(failures)} of #{length(cases)} cases failed:\n" <>
               Enum.join(Enum.take(failures, 25), "\n")
    end
  end

  defp check(%{op: op, family: family} = c) do
    row = Map.fetch!(rows(), op)
    outs = List.wrap(apply(N, op, [s() | call_args(row, c)]))

    if length(outs) != length(c.outs),
      do: raise("#{length(outs)} outputs, expected #{length(c.outs)}")

    Enum.zip(outs, c.outs)
    |> Enum.find_value(fn {actual, {dtype, shape, bin}} ->
      cond do
        Emily.dtype(actual) != dtype ->
          "#{describe(c)}: dtype #{inspect(Emily.dtype(actual))}, expected #{inspect(dtype)}"

        Emily.shape(actual) != shape ->
          "#{describe(c)}: shape #{inspect(Emily.shape(actual))}, expected #{inspect(shape)}"

        true ->
          expected = Emily.Codec.unpack(bin, dtype)
          mismatch(l(actual), expected, tolerance(family, op, dtype), c)
      end
    end)
  rescue
    e -> "#{describe(c)}: raised #{Exception.message(e)}"
  end

  defp tolerance(_family, _op, dtype) when not is_map_key(@elementwise, dtype), do: :exact

  defp tolerance(family, op, dtype) do
    cond do
      family in ["reduce", "scan"] and op not in [:max, :min, :cummax, :cummin] ->
        @accumulating[dtype]

      op in @approximate_ops and Map.has_key?(@approximate, dtype) ->
        @approximate[dtype]

      true ->
        @elementwise[dtype]
    end
  end

  defp mismatch(actual, expected, tol, c) do
    actual
    |> Enum.zip(expected)
    |> Enum.with_index()
    |> Enum.find_value(fn {{a, e}, i} ->
      if not close?(a, e, tol),
        do: "#{describe(c)}: element #{i} is #{inspect(a)}, expected #{inspect(e)}"
    end)
  end

  defp close?(a, e, :exact), do: a == e
  defp close?(a, a, _), do: true

  defp close?(a, e, {rtol, atol}) when is_float(a) and is_float(e),
    do: abs(a - e) <= rtol * abs(e) + atol

  defp close?(_, _, _), do: false

  defp describe(c) do
    ins = Enum.map_join(c.ins, ", ", fn {d, s, _} -> "#{type_name(d)}#{inspect(s)}" end)
    params = Enum.map_join(c.params, " ", fn {k, v} -> "#{k}=#{v}" end)
    "#{c.op}(#{ins}) #{params}" |> String.trim()
  end

  defp type_name(:bool), do: "bool"
  defp type_name({k, b}), do: "#{k}#{b}"

  # The row's arguments in table order: tensors from the `in` lines, the rest parsed
  # from the case's `name=value` params by their table type.
  defp call_args(row, c) do
    {args, []} =
      Enum.map_reduce(row.args, c.ins, fn
        {_, "tensor"}, [{dtype, shape, bin} | rest] ->
          {Emily.from_binary(bin, shape, dtype), rest}

        {_, "tensor?"}, ins ->
          {nil, ins}

        {name, type}, ins ->
          {parse_param(type, Map.fetch!(c.params, Atom.to_string(name))), ins}
      end)

    args
  end

  defp parse_param(int, v) when int in ["int", "int64"], do: String.to_integer(v)
  defp parse_param("bool", v), do: v == "true"
  defp parse_param("str", v), do: v

  defp parse_param("ints", v),
    do: v |> String.split(",", trim: true) |> Enum.map(&String.to_integer/1)

  defp rows do
    for row <- Emily.Native.Table.rows(), into: %{}, do: {row.name, row}
  end

  defp read_cases(path) do
    family = Path.basename(path, ".fixtures")

    path
    |> File.stream!()
    |> Stream.map(&String.trim_trailing/1)
    |> Stream.reject(&(&1 == "" or String.starts_with?(&1, "#")))
    |> Enum.reduce({[], nil}, fn line, {done, cur} ->
      case String.split(line, " ") do
        ["case", op | params] ->
          params = Map.new(params, &List.to_tuple(String.split(&1, "=", parts: 2)))
          {done, %{op: String.to_atom(op), family: family, params: params, ins: [], outs: []}}

        ["in" | t] ->
          {done, %{cur | ins: cur.ins ++ [tensor_line(t)]}}

        ["out" | t] ->
          {done, %{cur | outs: cur.outs ++ [tensor_line(t)]}}

        ["end"] ->
          {[cur | done], nil}
      end
    end)
    |> elem(0)
    |> Enum.reverse()
  end

  # The fixtures are little-endian, as are the hosts MLX runs on (x86_64, arm64), so the
  # bytes are already in the native order Emily.from_binary and Emily.Codec expect.
  defp tensor_line([dtype, shape, b64]) do
    {parse_dtype(dtype), parse_shape(shape), Base.decode64!(b64)}
  end

  defp parse_shape("-"), do: {}

  defp parse_shape(s),
    do: s |> String.split("x") |> Enum.map(&String.to_integer/1) |> List.to_tuple()

  defp parse_dtype("bool"), do: :bool
  defp parse_dtype("bf16"), do: {:bf, 16}

  defp parse_dtype(<<k, bits::binary>>) when k in ~c"fsu",
    do: {List.to_atom([k]), String.to_integer(bits)}
end
