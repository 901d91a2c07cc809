# One Qwen3-0.6B-shaped bf16 decode step through Emily.Native, op for op the same as
# bench/gpu/reference.py's: 28 layers, hidden 1024, 16 query / 8 KV heads, head dim 128,
# MLP 3072, a 512-long KV window, fast rms_norm / rope / attention, and the LM head.
defmodule GpuDecode do
  alias Emily.Native, as: N

  @layers 28
  @h 1024
  @nq 16
  @nkv 8
  @d 128
  @f 3072
  @kv 512
  @vocab 151_936
  @bf16 {:bf, 16}
  @weights [:ln1, :ln2, :qn, :kn, :wq, :wk, :wv, :wo, :wg, :wu, :wd, :k, :v]

  def run(s) do
    scale = N.full(s, {}, 0.02, @bf16)
    w = fn shape -> N.multiply(s, GpuBench.data(s, shape, @bf16), scale) end
    ones = fn n -> N.full(s, {n}, 1.0, @bf16) end

    layers =
      for _ <- 1..@layers do
        %{
          ln1: ones.(@h),
          ln2: ones.(@h),
          qn: ones.(@d),
          kn: ones.(@d),
          wq: w.({@h, @nq * @d}),
          wk: w.({@h, @nkv * @d}),
          wv: w.({@h, @nkv * @d}),
          wo: w.({@nq * @d, @h}),
          wg: w.({@h, @f}),
          wu: w.({@h, @f}),
          wd: w.({@f, @h}),
          k: w.({1, @nkv, @kv, @d}),
          v: w.({1, @nkv, @kv, @d})
        }
      end

    norm = ones.(@h)
    head = w.({@h, @vocab})
    x0 = w.({1, 1, @h})
    Emily.eval([norm, head, x0 | Enum.flat_map(layers, &Map.values/1)])

    # Python drops the step's intermediates when `step()` returns, before `mx.eval`, so
    # MLX frees each buffer as soon as its last consumer has run. Here the handles die at
    # the process's next garbage collection: collecting before the eval does the same.
    op_by_op_step = fn ->
      out = step(s, layers, norm, head, x0)
      :erlang.garbage_collect()
      GpuBench.eval_and_drop(out)
    end

    # Without polling, and with 50 us of it (Emily.Stream.set_spin/1):
    # a polling worker builds each node as it is queued, while the caller queues the next.
    previous = Emily.Stream.set_spin(0)
    op_by_op = GpuBench.best(op_by_op_step, 20, 3)
    Emily.Stream.set_spin(50)
    op_by_op_spin = GpuBench.best(op_by_op_step, 20, 3)
    Emily.Stream.set_spin(previous)

    # The same step as one Emily.Program: one native call per step, and the
    # intermediates live and die inside it.
    inputs =
      Enum.flat_map(layers, fn p -> Enum.map(@weights, &Map.fetch!(p, &1)) end) ++
        [norm, head, x0]

    {instrs, out} = program_step()

    runs =
      for compile <- [false, true] do
        prog = Emily.Program.new(instrs, inputs: length(inputs), outputs: [out], compile: compile)

        t =
          GpuBench.best(
            fn -> GpuBench.eval_and_drop(hd(Emily.Program.run(prog, inputs, stream: s))) end,
            20,
            3
          )

        {compile, t}
      end

    # The same program through Program.eval/3: built and evaluated inside the call.
    prog = Emily.Program.new(instrs, inputs: length(inputs), outputs: [out])

    program_eval =
      GpuBench.best(
        fn -> Emily.release(hd(Emily.Program.eval(prog, inputs, stream: s))) end,
        20,
        3
      )

    # The program computes what the op-by-op step computes, run or evaluated in the call.
    b = step(s, layers, norm, head, x0)

    max_diff =
      for [a] <- [
            Emily.Program.run(prog, inputs, stream: s),
            Emily.Program.eval(prog, inputs, stream: s)
          ] do
        diff = N.subtract(s, N.astype(s, a, {:f, 32}), N.astype(s, b, {:f, 32}))
        hd(Emily.to_list(N.max(s, N.abs(s, diff), [0, 1, 2], false)))
      end
      |> Enum.max()

    %{
      op_by_op: op_by_op,
      op_by_op_spin: op_by_op_spin,
      program: runs[false],
      program_eval: program_eval,
      compiled: runs[true],
      max_diff: max_diff
    }
  end

  # Instructions of one step over the inputs laid out as in run/1: 13 weights per layer,
  # then norm, head and x0. Returns {instructions, output slot}.
  defp program_step do
    n_inputs = @layers * length(@weights) + 3
    {norm, head, x0} = {n_inputs - 3, n_inputs - 2, n_inputs - 1}
    b = %{instrs: [], next: n_inputs}

    op = fn b, name, args ->
      {%{b | instrs: [{name, args} | b.instrs], next: b.next + 1}, b.next}
    end

    t0213 = [0, 2, 1, 3]

    {b, x} =
      Enum.reduce(0..(@layers - 1), {b, x0}, fn l, {b, x} ->
        p = Map.new(Enum.with_index(@weights), fn {k, i} -> {k, l * length(@weights) + i} end)
        {b, h} = op.(b, :rms_norm, [x, p.ln1, 1.0e-6])
        {b, q} = op.(b, :matmul, [h, p.wq])
        {b, q} = op.(b, :reshape, [q, {1, 1, @nq, @d}])
        {b, k} = op.(b, :matmul, [h, p.wk])
        {b, k} = op.(b, :reshape, [k, {1, 1, @nkv, @d}])
        {b, v} = op.(b, :matmul, [h, p.wv])
        {b, v} = op.(b, :reshape, [v, {1, 1, @nkv, @d}])
        {b, v} = op.(b, :transpose, [v, t0213])
        {b, q} = op.(b, :rms_norm, [q, p.qn, 1.0e-6])
        {b, q} = op.(b, :transpose, [q, t0213])
        {b, q} = op.(b, :rope, [q, @d, false, 1.0e6, 1.0, @kv, nil])
        {b, k} = op.(b, :rms_norm, [k, p.kn, 1.0e-6])
        {b, k} = op.(b, :transpose, [k, t0213])
        {b, k} = op.(b, :rope, [k, @d, false, 1.0e6, 1.0, @kv, nil])
        {b, kc} = op.(b, :slice, [p.k, [0, 0, 1, 0], [1, @nkv, @kv, @d], [1, 1, 1, 1]])
        {b, ks} = op.(b, :concatenate, [[kc, k], 2])
        {b, vc} = op.(b, :slice, [p.v, [0, 0, 1, 0], [1, @nkv, @kv, @d], [1, 1, 1, 1]])
        {b, vs} = op.(b, :concatenate, [[vc, v], 2])

        {b, o} =
          op.(b, :scaled_dot_product_attention, [q, ks, vs, :math.pow(@d, -0.5), "", nil, nil])

        {b, o} = op.(b, :transpose, [o, t0213])
        {b, o} = op.(b, :reshape, [o, {1, 1, @nq * @d}])
        {b, o} = op.(b, :matmul, [o, p.wo])
        {b, x} = op.(b, :add, [x, o])
        {b, h} = op.(b, :rms_norm, [x, p.ln2, 1.0e-6])
        {b, g} = op.(b, :matmul, [h, p.wg])
        {b, sg} = op.(b, :sigmoid, [g])
        {b, g} = op.(b, :multiply, [g, sg])
        {b, u} = op.(b, :matmul, [h, p.wu])
        {b, a} = op.(b, :multiply, [g, u])
        {b, d} = op.(b, :matmul, [a, p.wd])
        op.(b, :add, [x, d])
      end)

    {b, y} = op.(b, :rms_norm, [x, norm, 1.0e-6])
    {b, y} = op.(b, :matmul, [y, head])
    {Enum.reverse(b.instrs), y}
  end

  defp step(s, layers, norm, head, x0) do
    rms = fn x, g -> N.rms_norm(s, x, g, 1.0e-6) end
    rope = fn x -> N.rope(s, x, @d, false, 1.0e6, 1.0, @kv, nil) end
    t0213 = [0, 2, 1, 3]

    x =
      Enum.reduce(layers, x0, fn p, x ->
        h = rms.(x, p.ln1)
        q = N.reshape(s, N.matmul(s, h, p.wq), {1, 1, @nq, @d})
        k = N.reshape(s, N.matmul(s, h, p.wk), {1, 1, @nkv, @d})
        v = N.transpose(s, N.reshape(s, N.matmul(s, h, p.wv), {1, 1, @nkv, @d}), t0213)
        q = rope.(N.transpose(s, rms.(q, p.qn), t0213))
        k = rope.(N.transpose(s, rms.(k, p.kn), t0213))
        # A 512-long window ending at the new token: cache[1:] ++ new.
        ks =
          N.concatenate(
            s,
            [N.slice(s, p.k, [0, 0, 1, 0], [1, @nkv, @kv, @d], [1, 1, 1, 1]), k],
            2
          )

        vs =
          N.concatenate(
            s,
            [N.slice(s, p.v, [0, 0, 1, 0], [1, @nkv, @kv, @d], [1, 1, 1, 1]), v],
            2
          )

        o = N.scaled_dot_product_attention(s, q, ks, vs, :math.pow(@d, -0.5), "", nil, nil)
        o = N.reshape(s, N.transpose(s, o, t0213), {1, 1, @nq * @d})
        x = N.add(s, x, N.matmul(s, o, p.wo))
        h = rms.(x, p.ln2)
        g = N.matmul(s, h, p.wg)
        act = N.multiply(s, N.multiply(s, g, N.sigmoid(s, g)), N.matmul(s, h, p.wu))
        N.add(s, x, N.matmul(s, act, p.wd))
      end)

    N.matmul(s, rms.(x, norm), head)
  end
end
