if Code.ensure_loaded?(Nx) do
  defmodule Emily.Compiler do
    @moduledoc """
    A `defn` compiler (`Nx.Defn.Compiler`) that runs numerical definitions on MLX.

        Nx.Defn.jit(&MyModule.predict/2, compiler: Emily.Compiler).(params, input)
        Nx.Defn.default_options(compiler: Emily.Compiler)

    ## Paths

    The **native path** (the default) lowers the graph once (at `Nx.Defn.compile`,
    or at the first `Nx.Defn.jit` call for given input shapes and types: see `:cache`)
    into one `Emily.Program` (or a few, around what runs on the host: see below)
    and replays it per run in one native call (from the third run on inputs of one
    kind, rebuilding the graph from a tape: see `Emily.Program`), with the inputs
    (and the graph's captured tensors) as the program's inputs, returning its outputs
    evaluated (`Emily.Program.eval/3`: the call builds and evaluates the graph itself,
    with no hop to the stream's worker and back); with `compile: true` the program is also
    fused with `mx::compile` (see `Emily.Program`). It lowers, over the
    types MLX computes with (not f64 on a GPU):

      * parameters (vectorized ones too: Nx writes their graph over the devectorized
        shapes), constants (complex ones too), captured tensors, `iota` and `eye`;
      * elementwise unary and binary ops (comparisons and logical ops give Nx's u8;
        `erf_inv` as `Emily.Backend` computes it; on f64 not those `Emily.Backend`
        computes on `Nx.BinaryBackend` for accuracy), `select`, `clip`, `bitcast`,
        `real`, `imag`, `conjugate`, and `as_type` (float to integer as Nx converts:
        truncation, NaN to 0, infinities to the type's limits; from complex, of the
        real part);
      * `reshape`, `squeeze`, `transpose`, `reverse`, `broadcast`, `pad`, `slice` and
        `put_slice` (start indices numbers or tensors), `concatenate`, `stack`;
      * `dot` (batched too), `conv` (real types), `sum`, `product`, `reduce_max`,
        `reduce_min`, `all`, `any`, `argmax`, `argmin`, `window_sum`,
        `window_product`, `window_max`, `window_min` and the window scatters (their
        gradients), `reduce` and `window_reduce` whose function is one `add`,
        `multiply`, `max` or `min` of its arguments, `sort`, `argsort`, `fft`, `ifft`;
      * `gather`, `indexed_add`, `indexed_put`, and the `take`, `take_along_axis`,
        cumulative and `logical_not` blocks, each as the MLX op `Emily.Backend` runs
        (indices clamped on reads, dropped on writes; with `:debug_bounds_check` these
        fall back, so that the backend checks them);
      * `Emily.Fast`'s blocks (f16, bf16, f32) as MLX's fused kernels; on the CPU,
        `Nx.LinAlg`'s Cholesky, solve and determinant (up to 3x3) as LAPACK, as
        `Emily.Backend` computes them; every other block (`top_k`, `all_close`, a
        library's own) as its default implementation, lowered in turn;
      * `while` loops whose condition reads no input (over a range or a tensor's
        elements, counted loops, `Nx.Random`'s rounds): unrolled, up to 1024 passes
        and 4096 instructions, the condition computed before each pass when the graph
        is lowered (a longer loop runs on the host, as below);
      * `while` loops whose condition reads an input, outside other loops,
        conditionals and blocks: the loop runs on the host, and the graph becomes
        several programs: the loop's initial state, its condition, a pass (the body,
        and the condition on the state it makes), and the rest of the graph with the
        loop's results as inputs; the host reads the condition's value after each.
        Where a pass is one program (no host step inside the loop), the next pass is
        queued before the condition is read, so the device computes while the host
        reads and decides, as mlx-lm's generation does (a text generation's decoding
        loop, say). The pass queued after the last is dropped unread, which costs one
        pass's time at the end and the memory of one more loop state: `overlap: false`
        reads each condition before queueing the next pass, for a loop of few passes
        whose host part is small beside the device's (a large model on the CPU);
      * hooks (`hook`, `io_call`, `print_value`, tokens, `Nx.Serving`'s streaming, as
        each Nx release writes them: Nx 0.12's tokens, 0.13's `hook`, later `io_call`)
        and `runtime_call`, outside conditionals, blocks and unrolled loops (in a loop
        that runs on the host, on each pass): the call runs on the host between the
        program that computes its data and the program of the rest. A hook with no
        callback (a named one not given in `:hooks`, and none inside what it watches)
        is its data, anywhere, and nothing runs on the host. The other linear algebra
        (QR, eigh, SVD, LU, larger determinants, `triangular_solve`, and all of it on a
        GPU) runs on the host in the same way, computed by `Emily.Backend` as on the
        evaluator path;
      * `cond` (and `if`): a clause whose predicate reads no input is decided when the
        graph is lowered; otherwise every branch is computed and the results
        selected, so an untaken branch costs its time. Where that cannot be (a branch
        with a host step of its own, or with linear algebra, which raises on the
        values a branch guards against), outside loops, conditionals and blocks, the
        conditional runs on the host: a program computes the predicates, the host
        picks the branch, and that branch's program runs, then the rest's. (Under
        `:debug_detect_nan_inf`, whose checks would see an untaken branch, a `cond`
        whose predicate reads an input is not lowered, nor is any host step.)

    A graph with anything else (a hook, a runtime call, linear algebra on the host, a
    conditional that cannot compute all its branches, or a `while` whose condition
    reads an input or that is too long to unroll, inside a conditional, a block or an
    unrolled loop, as in a vectorized `while` whose condition reads an input; a hook or
    a runtime call on vectorized tensors; `reduce` and `window_reduce` with another
    function, complex convolutions, other types) runs whole on the evaluator path
    (below) and emits `[:emily, :compiler, :evaluator_fallback]` telemetry with
    `%{reason: reason}` (`{:op, op}`, `{:type, type}`, `{:while,
    :condition_reads_input}`, ...; an error while lowering a graph it traced, a bug,
    falls back too, as `{:lowering_failed, exception, message}`); the graph is not
    lowered again.

    What reads no input (constants, iotas and what is computed from them alone, such
    as a causal mask) is computed once, when the graph is lowered, and held by the
    compiled function as one more input of the program, so that runs do not recompute
    it: each value up to 1 MiB; a larger one is computed on every run from the smaller
    values it is made from. With `:debug_detect_nan_inf` (`Emily.Debug`), the program
    also counts the non-finite values of each result `Emily.Backend` would check
    (`dot`, and `Emily.Fast`'s norms and attention), and the run raises as the backend
    would.

    ### Fusion

    The native path also recognises, in the graphs Bumblebee's and Axon's layers build,
    the subgraphs that compute RMS norm (Bumblebee's `rms_norm`, either upcast mode),
    layer norm (Axon's `layer_norm`), rotary embeddings (below) and scaled dot-product
    attention (Bumblebee's
    attention: `softmax(q·k * scale + bias) · v`, the bias its key and causal masks as
    0 and the type's lowest value, keys and values repeated over grouped heads), and
    runs MLX's fused kernel for each (those `Emily.Fast`'s blocks run): over the last
    axis, the same epsilon at the same place, the mean and the biased variance, the
    same additive mask (so a query that sees no key gets the mean of the values, as
    unfused), the same scale (a number), grouped-query heads given to the kernel
    unrepeated, the same result type and casts around the kernel. Anything else lowers
    op by op. The kernels compute their statistics and the softmax in f32: a graph that
    computes them in f32 gets the same values up to rounding; one that computes them in
    f16 or bf16 (Axon's layer norm, Bumblebee's softmax, in those types) gets the more
    precise result, within the type's rounding of the unfused one. The rewrites are
    off with `fuse: false` (`fuse: [:rms_norm, :rope]` allows only those, `fuse: [except:
    [:dots]]` all but those), and under `:debug_detect_nan_inf` (whose checks follow the
    ops `Emily.Backend` runs).

    Rotary embeddings (Bumblebee's `x * cos + rotate_half(x) * sin`, the tables' rows
    taken at `position_ids`) are rewritten where each row holds one position, as in a
    decoding step: MLX's kernel takes positions as offsets from which it counts, so the
    prompt's pass, whose positions can be any, lowers op by op. The tables must be
    `cos` and `sin` of positions times frequencies (those of the base, or of a linear,
    dynamic or Llama 3 scaling): the lowering finds the frequencies from the tables,
    checks them against every row within f32's rounding of the angles, and gives
    them to the kernel; other tables (longrope's rescaled ones) are not rewritten.
    The kernel computes in f32, so a bf16 graph, which multiplies by tables rounded
    to bf16, gets the more precise result.

    Axon's `gelu` (`((erf(x / sqrt(2)) + 1) * x) / 2`, its constants as Axon writes them)
    becomes one instruction that computes those five ops, each rounded as the graph
    rounds it, with the same values: on a CPU, one pass over the activation instead of
    five (f32; other types run the ops); on a GPU, one kernel that MLX's compiler fuses
    from the same ops.

    Axon's `silu` (`sigmoid(x) * x`), and a gated unit's `up * silu(gate)` (Bumblebee's
    gated feed-forward of Llama, Qwen, Mistral and their kin; `up` of the same shape and
    type), become one instruction that computes those ops, each rounded as the graph
    rounds it, with the same values: on a CPU, one pass in f32 (other types run the
    ops); on a GPU, one kernel that MLX's compiler fuses from the same ops, where the
    graph ran three.

    Axon's dense layer (`Nx.dot(x, [-1], kernel, [0]) + bias`, the bias a vector of the
    kernel's columns, one type) becomes one instruction that, where the product is a
    matrix product, has BLAS add the bias as it stores the result: one pass over it
    instead of two, one kernel instead of two on a GPU. Each element is the same
    products and sum, summed in another order, so within the type's rounding of the
    unfused result. A decoding step's rows (Emily's row kernels) and half types on a CPU
    keep the product and the sum.

    A slice of a product that keeps all of the second operand's free axes (Bumblebee's
    `logits[[.., -1]]` of an LM head applied to every position of the prompt) becomes
    the product of the slice: only the rows kept are computed, each the same dot
    product.

    Products of one input by several weights (`Nx.dot(x, [-1], w, [0])` of the same `x`,
    each `w` an input of the function: a layer's query, key and value projections, a
    gated unit's gate and up) run as one instruction for two or three of them. A
    decoding step's rows go through Emily's row kernels in one pass (one GPU kernel
    launch, one wake of the CPU's helpers, where each product took its own); other rows
    run the products the `dot`s would. Each product's values are the same bits as
    alone.

    Keys and values repeated over grouped heads and then written into a cache
    (Bumblebee's `put_slice` of `repeat_interleave(x, g, axis: 2)` into a cache of all
    the query heads, as its grouped-query models cache them) are written from the
    unrepeated tensor, without the copy that materialises the repeat: the same
    elements, any type, in one instruction (on a CUDA GPU one kernel, writing into the
    cache's buffer where it can be donated).

    Each lowered program that rewrites emits `[:emily, :compiler, :fusion]` telemetry,
    measurements `%{count: n}`, metadata `%{rewrites: rewrites}` (as
    `fusions/3` lists them); `fusions/3` lists them for a function without running it.

    The **evaluator path** (`native: false`, and where the native path falls back) walks
    the `Nx.Defn.Expr` graph with `Nx.Defn.Evaluator`, with `Emily.Backend` as the
    default backend: every node becomes one lazy MLX op on the stream, `while` and
    `cond` predicates are read on the host, and `Nx.block/4` reaches `Emily.Backend`'s
    `c:Nx.Backend.block/4`. Inputs that are not Emily tensors are copied in. On both
    paths an input the graph does not read is never asked for (an `Nx.LazyContainer`'s
    value is not computed). Both paths compute each op with the same MLX ops and casts,
    so their results agree; the native path runs a graph in one native call rather than
    one op per node (on bench/'s graphs, 1.3 to 5.9 times as fast).

    ## Options

      * `:device` - `:cpu` or `:gpu`: where constants and copied-in inputs go (default
        `Emily.default_device/0`).
      * `:stream` - an `Emily.Stream` to run on (else the calling process's stream).
      * `:max_concurrency` - the number of partitions (each with its own stream) for
        `Nx.Serving` with `partitions: true`; default 1.
      * `:hooks` - callbacks for named hooks (`hook`, `io_call`, tokens' hooks), as
        `Nx.Defn.Evaluator` takes them (this is how `Nx.Serving` streams and how
        `print_value` hooks are overridden).
      * `:native` - `false` for the evaluator path (default `true`: see above).
      * `:fuse` - on the native path, which rewrites of "Fusion" above may fire:
        `true` (the default) all, `false` none (every op lowered as it is), a list of
        the names `fusions/3` reports (`[:rms_norm, :scaled_dot_product_attention]`)
        those alone, `except: names` all but those. An unknown name raises.
      * `:overlap` - on the native path, `false` reads a host loop's condition
        before its next pass is queued (default `true`: see `while` above).
      * `:compile` - on the native path, compile the program with `mx::compile` (a
        graph deeper than a thread's stack can trace runs on the stream's worker, or
        there uncompiled: see `Emily.Program`). On the CPU, MLX builds each fused
        kernel it has not met before with the system C++ compiler, about half a second
        each on two cores (a training step of a few dozen kernels: seconds on its
        first call), and keeps them in the system's temporary directory
        (`mlx/<version>/cpu`), where later calls and later VMs find them.
      * `:cache` - keep the traced graph (and, on the native path, the lowered
        program; default `true`): the graph is traced on the first call of a
        `Nx.Defn.jit` function for given input shapes, types and options, and later
        calls run it again. Lowered programs are shared by all processes; traced
        graphs (the evaluator path's) are kept by the process that traced them, so a
        function of `Nx.Defn.compile` run in another process (as `Nx.Serving` runs
        each batch in a task) traces its graph there, once per process. What is kept,
        and the tensors the function captures, stay alive while kept (at most 512
        entries each: a cache is emptied when full); `false` traces on every call.

    Other options are accepted and passed through (libraries such as Axon pass their
    own).
    """

    @behaviour Nx.Defn.Compiler

    @telemetry? Code.ensure_loaded?(:telemetry)
    @cache Emily.Compiler.Cache
    @last_used {__MODULE__, :last_used}

    alias Emily.Compiler.Native

    @impl true
    def __jit__(key, vars, fun, args_list, opts) do
      __compile__(key, vars, fun, opts).(args_list)
    end

    @impl true
    def __compile__(key, vars, fun, opts) do
      if Keyword.get(opts, :native, true) do
        native(key, vars, fun, opts)
      else
        evaluator(key, vars, fun, opts)
      end
    end

    # The graph is lowered once, here; each run replays the program in one native call.
    defp native(key, vars, fun, opts) do
      device =
        cond do
          device = opts[:device] -> device
          stream = opts[:stream] -> Emily.Stream.device(stream)
          true -> Emily.default_device()
        end

      case lowered(key, vars, fun, opts, device) do
        {:ok, {plan, template, checks, read}} ->
          # The bytes of a run's results, for the process's collection
          # (Emily.Memory.created/1): the same for every run of the program.
          bytes = Nx.Defn.Composite.reduce(template, 0, &(Nx.byte_size(&1) + &2))
          run = {plan, template, bytes, checks, read}

          fn args_list ->
            Emily.Memory.collect_due()
            Enum.map(args_list, &run_native(run, &1, opts))
          end

        {:unsupported, reason} ->
          evaluator_fallback(reason)
          evaluator(key, vars, fun, opts)
      end
    end

    # `Nx.Defn.jit` calls `__jit__` on every run, and tracing (plus lowering) a graph
    # costs about as much again as running it on small inputs: traced graphs and lowered
    # programs are kept, per function, input templates and options, as EXLA keeps its
    # executables. A graph that falls back is kept as such (with its reason), so that it
    # is not lowered again; each of its runs still reports the fallback.
    defp lowered(key, vars, fun, opts, device) do
      if Keyword.get(opts, :cache, true) do
        {fun_key, opts_key} = keyed(key, opts)
        cache_key = {:native, fun_key, args_keys(vars), device, opts_key}

        case cache_lookup(cache_key) do
          {:ok, result} ->
            result

          :error ->
            result = lower(vars, fun, opts, device)
            cache_store(cache_key, result)
            result
        end
      else
        lower(vars, fun, opts, device)
      end
    end

    defp lower(vars, fun, opts, device) do
      opts = Keyword.delete(opts, :cache) ++ [device: device]
      catch_unsupported(fn -> Native.lower(vars, fun, opts) end)
    end

    # A stream stands in a cache key for its device: what is kept does not depend on the
    # stream that runs it (programs and traced graphs run on any stream of the device),
    # and a handle in a key would keep the stream, and its worker thread, alive for as
    # long as the entry (Nx.Serving makes new streams for its partitions at each start).
    # (The `:cache` option is part of the key, as it is `true` wherever a key is made.)
    defp cache_opts(opts) do
      case Keyword.pop(opts, :stream) do
        {nil, opts} -> cache_term(opts)
        {stream, opts} -> [{:stream_device, Emily.Stream.device(stream)} | cache_term(opts)]
      end
    end

    # The function's and the options' part of a cache key (`cache_term/1`), made once for
    # the last pair the process jitted: a function called in a loop comes as the same
    # terms each time, which compare at no cost (identical terms are not walked).
    @keyed {__MODULE__, :keyed}

    defp keyed(key, opts) do
      case Process.get(@keyed) do
        {^key, ^opts, keyed} ->
          keyed

        _ ->
          keyed = {cache_term(key), cache_opts(opts)}
          Process.put(@keyed, {key, opts, keyed})
          keyed
      end
    end

    # `term` (a function, options) made fit for a key: a defn graph in it (a closure
    # over a traced expression, as Nx.Defn.Graph.run/2 jits) is a DAG, which hashing,
    # comparing or copying into a table walks as the tree it unfolds to (exponential in
    # its depth where nodes are shared, and in one uninterruptible call), so each of its
    # nodes stands as its id, unique to it; a closure stands as its code and what it
    # captures, so made. Equal terms give equal keys, as before.
    defp cache_term(%Nx.Tensor{data: %Nx.Defn.Expr{id: id}}), do: {Nx.Defn.Expr, id}
    defp cache_term(%Nx.Defn.Expr{id: id}), do: {Nx.Defn.Expr, id}

    defp cache_term(fun) when is_function(fun) do
      case Function.info(fun, :type) do
        {:type, :local} ->
          info = Function.info(fun)
          {:fun, info[:module], info[:new_index], info[:new_uniq], cache_term(info[:env])}

        _ ->
          fun
      end
    end

    defp cache_term([head | tail]), do: [cache_term(head) | cache_term(tail)]

    defp cache_term(tuple) when is_tuple(tuple),
      do: tuple |> Tuple.to_list() |> Enum.map(&cache_term/1) |> List.to_tuple()

    defp cache_term(%{} = map), do: :maps.map(fn _key, value -> cache_term(value) end, map)
    defp cache_term(other), do: other

    # The parameters' templates: tensors, and the tuples of them that functions take
    # (parameters), walked directly, as this runs on every call; other containers through
    # `Nx.Defn.Composite`.
    defp args_keys([var | vars]), do: [args_key(var) | args_keys(vars)]
    defp args_keys([]), do: []

    defp args_key(%Nx.Tensor{} = t), do: {t.type, t.shape, t.names, t.vectorized_axes}

    defp args_key(tuple) when is_tuple(tuple),
      do: tuple |> Tuple.to_list() |> args_keys() |> List.to_tuple()

    defp args_key(var) do
      Nx.Defn.Composite.traverse(var, fn
        %Nx.Tensor{} = t -> {t.type, t.shape, t.names, t.vectorized_axes}
        other -> other
      end)
    end

    # The table belongs to the application (Emily.Stream.Defaults); without it, nothing
    # is kept. The entry a process used last is also kept in its dictionary, so that a
    # function called in a loop is found without copying its entry out of the table.
    defp cache_lookup(key) do
      case Process.get(@last_used) do
        {^key, lowered} ->
          {:ok, lowered}

        _ ->
          case :ets.lookup(@cache, key) do
            [{_, lowered}] ->
              Process.put(@last_used, {key, lowered})
              {:ok, lowered}

            [] ->
              :error
          end
      end
    rescue
      ArgumentError -> :error
    end

    # Bounded, so that jitting fresh closures in a loop (each capturing new tensors, each
    # a new key) cannot hold on to their programs and tensors without end.
    @cache_limit 512

    # The evaluator's compiled functions hold the traced graph, a DAG: copied out of the
    # process (into a table, or a message), it is flattened, and a graph with much
    # sharing becomes far larger than itself (Nx.LinAlg.eigh's default: some 100 GB).
    # They are kept in the process that traced them, bounded as the table is.
    @local {__MODULE__, :evaluator}

    defp locally_cached(key, make) do
      kept = Process.get(@local, %{})

      case kept do
        %{^key => compiled} ->
          compiled

        _ ->
          compiled = make.()
          kept = if map_size(kept) >= @cache_limit, do: %{}, else: kept
          Process.put(@local, Map.put(kept, key, compiled))
          compiled
      end
    end

    defp cache_store(key, lowered) do
      if :ets.info(@cache, :size) >= @cache_limit, do: :ets.delete_all_objects(@cache)
      :ets.insert(@cache, {key, lowered})
    rescue
      ArgumentError -> false
    end

    defp catch_unsupported(fun) do
      {:ok, fun.()}
    catch
      {:unsupported, reason} -> {:unsupported, reason}
    end

    defp run_native({plan, template, bytes, checks, read}, args, opts) do
      s =
        opts[:stream] || Emily.Stream.selected() ||
          if(device = opts[:device],
            do: Emily.Stream.default(device),
            else: Emily.Stream.current()
          )

      refs = Native.Plan.run(plan, inputs(args, read, s), s)

      refs =
        case checks do
          [] ->
            refs

          checks ->
            {refs, counts} = Enum.split(refs, length(refs) - length(checks))
            Native.check_finite!(counts, checks)
            refs
        end

      Emily.Memory.created(bytes)
      results(template, refs, s)
    end

    # The outputs in the template's container (a lone tensor is the common case).
    defp results(%Nx.Tensor{} = t, [ref], s), do: %{t | data: %Emily.Backend{ref: ref, stream: s}}

    defp results(template, refs, s) do
      {result, []} =
        Nx.Defn.Composite.traverse(template, refs, fn t, [ref | rest] ->
          {%{t | data: %Emily.Backend{ref: ref, stream: s}}, rest}
        end)

      result
    end

    # The arrays of the parameters the graph reads; in place of each other one (not
    # asked for, as the evaluator does not ask: see Native.lower/3), an array the program
    # does not read.
    defp inputs([thunk | args], [:read | read], s),
      do: [native_input(thunk.(), s) | inputs(args, read, s)]

    defp inputs([_thunk | args], [{:unread, ref} | read], s), do: [ref | inputs(args, read, s)]
    defp inputs([], [], _s), do: []

    defp native_input(%Nx.Tensor{data: %Emily.Backend{ref: ref}}, _stream), do: ref

    defp native_input(%Nx.Tensor{} = t, stream),
      do: Nx.backend_copy(t, {Emily.Backend, device: Emily.Stream.device(stream)}).data.ref

    defp native_input(number, stream) when is_number(number),
      do: native_input(Nx.tensor(number, backend: Nx.BinaryBackend), stream)

    defp evaluator(key, vars, fun, opts) do
      backend = __to_backend__(opts)
      stream = opts[:stream]
      {fun_key, opts_key} = keyed(key, opts)
      {cache?, opts} = Keyword.pop(opts, :cache, true)
      evaluator_opts = Keyword.drop(opts, [:device, :stream, :native, :compile, :fuse, :overlap])

      compile = fn ->
        in_context(stream, backend, fn ->
          Nx.Defn.Evaluator.__compile__(key, vars, fun, evaluator_opts)
        end)
      end

      # The function returned goes wherever its caller sends it (Nx.Serving runs each batch
      # in a task), and copying flattens a traced graph (see locally_cached/2); Nx 0.13's
      # evaluator holds a token hook's watched expression with every node's arguments, the
      # whole model for Bumblebee's generation. So the function holds what traces the
      # graph, not the graph: it is traced here, and once in each other process it runs in.
      compiled =
        if cache? do
          local_key = {fun_key, args_keys(vars), opts_key}
          locally_cached(local_key, compile)
          fn -> locally_cached(local_key, compile) end
        else
          compile
        end

      fn args_list ->
        compiled = compiled.()

        in_context(stream, backend, fn ->
          Enum.flat_map(args_list, fn args ->
            compiled.([Enum.map(args, &to_emily(&1, backend))])
          end)
        end)
      end
    end

    @doc """
    The fused kernels the native path runs for `fun` on `args` (tensors or templates),
    found by lowering its graph without running it, with the compiler options `opts`
    (see "Fusion"): one map per rewrite, in the order the lowering made them, each with
    `:rewrite` (`:rms_norm`, `:layer_norm`, `:rope`, `:scaled_dot_product_attention`,
    `:gelu`, `:silu`, `:dense`, `:sliced_dot`, `:repeated_update` or `:dots`),
    the result's `:shape` and `:type` (`:dots`: `:shapes`, one per product, and
    `:products`, their number), and the kernel's parameters (`:eps`, `:weight`,
    `:bias`; `:dims`; `:scale`, `:mask`, `:heads` as `{query_heads, key_value_heads}`;
    `:gated`; `:groups`). Empty
    with `fuse: false`, and where the graph runs on the evaluator path; with a list of
    rewrites as `:fuse`, only those appear.

        Emily.Compiler.fusions(&MyModel.forward/2, [params, input])
        #=> [%{rewrite: :rms_norm, eps: 1.0e-6, weight: true, shape: {1, 4, 32}, ...}, ...]
    """
    @spec fusions(function, [term], keyword) :: [map]
    def fusions(fun, args, opts \\ []) when is_function(fun) and is_list(args),
      do: Native.fusions(fun, args, opts)

    @impl true
    def __partitions_options__(opts) do
      device = opts[:device] || Emily.default_device()

      for _ <- 1..Keyword.get(opts, :max_concurrency, 1)//1 do
        Keyword.put(opts, :stream, Emily.Stream.new(device))
      end
    end

    @impl true
    def __to_backend__(opts) do
      device =
        cond do
          device = opts[:device] -> device
          stream = opts[:stream] -> Emily.Stream.device(stream)
          true -> nil
        end

      if device, do: {Emily.Backend, device: device}, else: {Emily.Backend, []}
    end

    defp in_context(nil, backend, fun), do: Nx.with_default_backend(backend, fun)

    defp in_context(stream, backend, fun) do
      Emily.Stream.with_stream(stream, fn -> Nx.with_default_backend(backend, fun) end)
    end

    # Parameters arrive as thunks; ones on other backends are copied in so the graph's
    # ops dispatch to Emily.Backend (Emily tensors of other streams are used as they
    # are: Emily.Native evaluates a lazy one on its own stream first).
    defp to_emily(thunk, backend) do
      fn ->
        case thunk.() do
          %Nx.Tensor{data: %Emily.Backend{}} = t -> t
          %Nx.Tensor{data: %Nx.Defn.Expr{}} = t -> t
          %Nx.Tensor{} = t -> Nx.backend_copy(t, backend)
          other -> other
        end
      end
    end

    defp evaluator_fallback(reason) do
      if @telemetry? do
        :telemetry.execute([:emily, :compiler, :evaluator_fallback], %{}, %{reason: reason})
      end

      :ok
    end
  end
end
