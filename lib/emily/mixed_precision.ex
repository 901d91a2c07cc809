if Code.ensure_loaded?(Nx) do
  defmodule Emily.MixedPrecision do
    @moduledoc """
    Mixed-precision training with Axon: the forward and backward passes in bf16 (or
    f16), the parameters kept and updated in f32, and dynamic loss scaling that skips
    the steps whose gradients overflow.

    It is Axon's own machinery, configured: `Axon.MixedPrecision`'s policy for the
    casts, `Axon.Loop.trainer/4`'s `:loss_scale` option for the scaling, and a wrapper
    around any Polaris optimizer for the skipping. Axon and Polaris are not
    dependencies of Emily: add them to your project to use this module.

        model
        |> Emily.MixedPrecision.trainer(:categorical_cross_entropy, Polaris.Optimizers.adam())
        |> Axon.Loop.run(data, Axon.ModelState.empty(), epochs: 5, compiler: Emily.Compiler)

    ## The recipe

      * **Casts** (`apply_policy/2`): every layer but the normalizations keeps its
        parameters in f32 (the *master copy*) and casts them, and its inputs, to the
        compute type (`:compute`, bf16 by default) as it runs; its output is cast back
        to f32, so the loss is computed in f32. The backward pass runs through the same
        casts: each layer's gradients are computed in the compute type and arrive at
        the parameters as f32.
      * **Loss scaling** (`loss_scale/1`): the loss is multiplied by a scale before the
        gradients are taken and the gradients divided by it after, so small gradients
        survive the compute type (f16's smallest normal is 6.1e-5; bf16 has f32's
        range and needs scaling far less, but gains the same overflow check). The
        scale starts at `:init_scale` (2^15); a step whose gradients hold an infinity
        or a NaN halves it (by `:factor`, down to `:min_scale`), and after `:period`
        consecutive good steps it doubles (up to `:max_scale`).
      * **Skipping** (`optimizer/1`): an overflowing step changes nothing: the
        optimizer's updates are zero and its state (moments, step count) is kept, so
        the parameters after the step are bitwise those before it. Layer state that
        is not a gradient (batch norm's running statistics) is updated as usual.

    The scale and the count of good steps are the loop's
    `step_state.loss_scale_state` (`%{loss_scale: f32, counter: s64}`), readable from
    any `Axon.Loop` event handler.

    On Emily, bf16 runs natively on every device. On the CPU, Emily computes bf16
    products in f32 (through BLAS, rounded once to bf16), and MLX's other bf16 kernels
    are no faster than f32 ones, so there mixed precision saves memory rather than time.
    """

    @compile {:no_warn_undefined,
              [Axon, Axon.MixedPrecision, Axon.Loop, Polaris.Optimizers, Polaris.Updates]}

    @default_except [:batch_norm, :layer_norm, :group_norm, :instance_norm]

    @doc """
    `Axon.MixedPrecision.create_policy/1` for the recipe: parameters and outputs f32,
    computation in `:compute` (`{:bf, 16}` by default, or `{:f, 16}`).
    """
    @spec policy(keyword) :: struct
    def policy(opts \\ []) do
      opts = Keyword.validate!(opts, compute: {:bf, 16})
      compute = Nx.Type.normalize!(opts[:compute])

      if compute not in [{:bf, 16}, {:f, 16}, {:f, 32}] do
        raise ArgumentError,
              "mixed precision: :compute must be {:bf, 16}, {:f, 16} or {:f, 32}, got " <>
                inspect(opts[:compute])
      end

      Axon.MixedPrecision.create_policy(params: {:f, 32}, compute: compute, output: {:f, 32})
    end

    @doc """
    `model` with the recipe's policy on every layer except those whose op is in
    `:except` (default: the normalization layers, `#{inspect(@default_except)}`,
    whose statistics want f32). `:compute` as in `policy/1`.
    """
    @spec apply_policy(struct, keyword) :: struct
    def apply_policy(model, opts \\ []) do
      opts = Keyword.validate!(opts, compute: {:bf, 16}, except: @default_except)

      Axon.MixedPrecision.apply_policy(model, policy(compute: opts[:compute]),
        except: opts[:except]
      )
    end

    @doc """
    Dynamic loss scaling for `Axon.Loop.train_step/4` and `Axon.Loop.trainer/4`'s
    `:loss_scale` option: `{init_fn, scale_fn, unscale_fn}`.

    Options:

      * `:init_scale` - the first scale (default `2 ** 15`).
      * `:period` - good steps in a row after which the scale grows (default 2000).
      * `:factor` - what the scale is divided by after an overflow and multiplied by
        after `:period` good steps (default 2).
      * `:min_scale`, `:max_scale` - its bounds (default 1 and 2^24).

    A step is good when every gradient is finite (no infinity, no NaN).
    """
    @spec loss_scale(keyword) :: {function, function, function}
    def loss_scale(opts \\ []) do
      opts =
        Keyword.validate!(opts,
          init_scale: 2 ** 15,
          period: 2000,
          factor: 2,
          min_scale: 1,
          max_scale: 2 ** 24
        )

      for key <- [:init_scale, :factor, :min_scale, :max_scale],
          not (is_number(opts[key]) and opts[key] > 0) do
        raise ArgumentError,
              "mixed precision: #{inspect(key)} must be a positive number, got " <>
                inspect(opts[key])
      end

      if not (is_integer(opts[:period]) and opts[:period] > 0) do
        raise ArgumentError,
              "mixed precision: :period must be a positive integer, got #{inspect(opts[:period])}"
      end

      init = opts[:init_scale] * 1.0

      init_fn = fn ->
        %{loss_scale: Nx.tensor(init, type: :f32), counter: Nx.tensor(0, type: :s64)}
      end

      scale_fn = fn loss, %{loss_scale: scale} ->
        Nx.Defn.Composite.traverse(loss, &Nx.multiply(&1, Nx.as_type(scale, &1.type)))
      end

      unscale_fn = fn grads, state -> unscale(grads, state, opts) end
      {init_fn, scale_fn, unscale_fn}
    end

    defp unscale(grads, %{loss_scale: scale, counter: counter}, opts) do
      inv = Nx.divide(1.0, scale)
      unscaled = Nx.Defn.Composite.traverse(grads, &Nx.multiply(&1, Nx.as_type(inv, &1.type)))
      finite = finite?(grads)
      grown = Nx.equal(Nx.add(counter, 1), opts[:period])

      up = Nx.min(Nx.multiply(scale, opts[:factor]), opts[:max_scale] * 1.0)
      down = Nx.max(Nx.divide(scale, opts[:factor]), opts[:min_scale] * 1.0)
      new_scale = Nx.select(finite, Nx.select(grown, up, scale), down)

      new_counter =
        Nx.select(Nx.logical_and(finite, Nx.logical_not(grown)), Nx.add(counter, 1), 0)

      {unscaled,
       %{loss_scale: Nx.as_type(new_scale, :f32), counter: Nx.as_type(new_counter, :s64)}}
    end

    @doc """
    `optimizer` (a Polaris `{init_fn, update_fn}` pair, or the name of one of
    `Polaris.Optimizers`' functions) made to skip steps whose gradients are not all
    finite: such a step returns zero updates and the optimizer state unchanged.
    """
    @spec optimizer({function, function} | atom) :: {function, function}
    def optimizer(name) when is_atom(name) do
      if Code.ensure_loaded?(Polaris.Optimizers) and
           function_exported?(Polaris.Optimizers, name, 0),
         do: optimizer(apply(Polaris.Optimizers, name, [])),
         else: optimizer({name})
    end

    def optimizer({init_fn, update_fn})
        when is_function(init_fn, 1) and is_function(update_fn, 3) do
      skipping = fn grads, state, params ->
        finite = finite?(grads)

        safe =
          Nx.Defn.Composite.traverse(grads, &Nx.select(finite, &1, Nx.tensor(0, type: &1.type)))

        {updates, new_state} = update_fn.(safe, state, params)

        updates =
          Nx.Defn.Composite.traverse(updates, &Nx.select(finite, &1, Nx.tensor(0, type: &1.type)))

        {updates, keep_unless(finite, new_state, state)}
      end

      {init_fn, skipping}
    end

    def optimizer(other) do
      raise ArgumentError,
            "mixed precision: expected a Polaris optimizer ({init_fn, update_fn}) or the " <>
              "name of one, got #{inspect(other)}"
    end

    @doc """
    `Axon.Loop.trainer/4` with the whole recipe: `model` under `apply_policy/2`, the
    optimizer under `optimizer/1` and `loss_scale/1` as the loop's `:loss_scale`.

    Options: `:compute` and `:except` (see `apply_policy/2`), `:loss_scale` (a keyword
    list for `loss_scale/1`), and the trainer's own (`:seed`, `:log`).
    """
    @spec trainer(struct, term, {function, function} | atom, keyword) :: struct
    def trainer(model, loss, optimizer, opts \\ []) do
      {mp, loop_opts} = Keyword.split(opts, [:compute, :except, :loss_scale])
      policy_opts = Keyword.take(mp, [:compute, :except])

      model
      |> apply_policy(policy_opts)
      |> Axon.Loop.trainer(
        loss,
        optimizer(optimizer),
        [loss_scale: loss_scale(Keyword.get(mp, :loss_scale, []))] ++ loop_opts
      )
    end

    # Whether every tensor of `container` is finite everywhere, as a u8 scalar.
    defp finite?(container) do
      [container]
      |> Nx.Defn.Composite.flatten_list()
      |> Enum.map(fn t ->
        t |> Nx.is_nan() |> Nx.logical_or(Nx.is_infinity(t)) |> Nx.any() |> Nx.logical_not()
      end)
      |> Enum.reduce(Nx.tensor(1, type: :u8), &Nx.logical_and/2)
    end

    # `new` where `pred`, else `old` (containers of one structure).
    defp keep_unless(pred, new, old) do
      {kept, []} =
        Nx.Defn.Composite.traverse(new, Nx.Defn.Composite.flatten_list([old]), fn n, [o | rest] ->
          {Nx.select(pred, n, o), rest}
        end)

      kept
    end
  end
end
