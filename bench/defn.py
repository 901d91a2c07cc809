"""Python MLX side of bench/defn.exs: the same graphs, op for op, on the same libmlx.

bench/defn.exs lowers each defn graph with Emily's native path and writes the program
(its instructions, input shapes and input data) to a file; this script turns each
instruction into the `mx` call it stands for, as straight-line Python (one statement
per MLX op, no interpreter in the timed path), and times it:

  * eager: build the graph, evaluate its outputs in one go, read them back to the host;
  * compiled: the same function through `mx.compile`.

It prints `name_eager us` and `name_compiled us` lines (best mean microseconds per run)
and writes each graph's eager and compiled results beside the dump, for bench/defn.exs
to compare with Emily's. Run by bench/defn.exs (with OpenBLAS preloaded, which is what
Emily links); alone, `python3 bench/defn.py DUMP [--source]` (`--source` prints the
generated functions). With `--serve` it times windows on request instead (`serve`), for
the paired comparison of bench/defn.exs and bench/program.exs.
"""
import ast
import math
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from bench import best, serve as serve_runs  # noqa: E402

DTYPES = {
    ("f", 16): "mx.float16", ("bf", 16): "mx.bfloat16", ("f", 32): "mx.float32",
    ("f", 64): "mx.float64", ("s", 8): "mx.int8", ("s", 16): "mx.int16",
    ("s", 32): "mx.int32", ("s", 64): "mx.int64", ("u", 8): "mx.uint8",
    ("u", 16): "mx.uint16", ("u", 32): "mx.uint32", ("u", 64): "mx.uint64",
    "bool": "mx.bool_",
}
NP = {("f", 32): np.float32, ("f", 64): np.float64, ("s", 32): np.int32, ("s", 64): np.int64,
      ("u", 8): np.uint8, ("u", 32): np.uint32, "bool": np.bool_}

# The op table's name is MLX's for these; their arguments are all tensors.
ELEMENTWISE = {
    "abs", "negative", "sign", "exp", "expm1", "log", "log1p", "sqrt", "rsqrt", "sin", "cos",
    "tan", "tanh", "sigmoid", "erf", "floor", "ceil", "logical_not", "isnan", "isinf",
    "add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "remainder",
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "logical_and",
    "logical_or", "where", "bitwise_and", "bitwise_or", "bitwise_xor",
}

# Instructions of several outputs (one slot each, in order).
OUTPUTS = {"dots2": 2, "dots3": 3}


def value(v):
    return {"nan": 'float("nan")', "infinity": 'float("inf")',
            "neg_infinity": 'float("-inf")'}.get(v, repr(v))


def dot_general(t, a, ca, ba, b, cb, bb, shape):
    """Emily's `dot` (cpp/linalg.cc, dot_general): transpose, reshape, matmul, reshape,
    each step left out where it would not change the array (as Emily does; MLX's own
    reshape skips an unchanged shape, its transpose does not skip the identity)."""
    sa, sb = shape(a), shape(b)
    ca, ba = [x % len(sa) for x in ca], [x % len(sa) for x in ba]
    cb, bb = [x % len(sb) for x in cb], [x % len(sb) for x in bb]
    fa = [i for i in range(len(sa)) if i not in ca and i not in ba]
    fb = [i for i in range(len(sb)) if i not in cb and i not in bb]
    prod = lambda s, axes: math.prod(s[i] for i in axes)  # noqa: E731
    m, k, n = prod(sa, fa), prod(sa, ca), prod(sb, fb)
    batch = [sa[i] for i in ba]
    out = tuple(batch + [sa[i] for i in fa] + [sb[i] for i in fb])

    def moved(x, perm):
        return f"mx.transpose(t{x}, {perm})" if perm != sorted(perm) else f"t{x}"

    at = f"mx.reshape({moved(a, ba + fa + ca)}, {tuple(batch + [m, k])})"
    bt = f"mx.reshape({moved(b, bb + cb + fb)}, {tuple(batch + [k, n])})"
    return f"t{t} = mx.reshape(mx.matmul({at}, {bt}), {out})"


def shift(t, op, a, b, dtype):
    """Emily's shifts (cpp/binary.cc, left_shift_safe and right_shift_safe): a count
    outside [0, width) gives 0 (a signed right shift, the sign fill), as in Nx."""
    d = dtype(a)
    name = str(d).split(".")[-1]
    bits = 8 * d.size
    big = f"mx.greater_equal(t{b}, mx.array({bits}, mx.{name}))"
    oor = f"mx.logical_or({big}, mx.less(t{b}, mx.array(0, mx.{name})))" if name.startswith("int") else big
    if op == "right_shift" and name.startswith("int"):
        return (f"o{t} = {oor}; "
                f"t{t} = mx.right_shift(t{a}, mx.where(o{t}, mx.array({bits - 1}, mx.{name}), t{b}))")
    zero = f"mx.array(0, mx.{name})"
    return (f"o{t} = {oor}; "
            f"t{t} = mx.where(o{t}, {zero}, mx.{op}(t{a}, mx.where(o{t}, {zero}, t{b})))")


def statement(t, op, args, shape, dtype):
    """The Python statement for instruction `op(args)` writing slot `t`."""
    if op in ("left_shift", "right_shift"):
        return shift(t, op, *args, dtype)
    if op in ELEMENTWISE:
        return f"t{t} = mx.{op}({', '.join(f't{a}' for a in args)})"
    if op == "dot":
        return dot_general(t, *args, shape)
    if op in ("dots2", "dots3"):
        x, axis, *ws = args
        return "; ".join(dot_general(t + i, x, [axis], [], w, [0], [], shape) for i, w in enumerate(ws))
    if op == "full":
        s, v, d = args
        return f"t{t} = mx.full({tuple(s)}, {value(v)}, dtype={DTYPES[d]})"
    if op == "arange":
        start, stop, step, d = args
        return f"t{t} = mx.arange({start}, {stop}, {step}, dtype={DTYPES[d]})"
    if op == "view":
        return f"t{t} = t{args[0]}.view({DTYPES[args[1]]})"
    if op == "astype":
        return f"t{t} = t{args[0]}.astype({DTYPES[args[1]]})"
    if op in ("reshape", "broadcast_to"):
        return f"t{t} = mx.{op}(t{args[0]}, {tuple(args[1])})"
    if op == "transpose":
        return f"t{t} = mx.transpose(t{args[0]}, {list(args[1])})"
    if op in ("squeeze", "flip"):
        return f"t{t} = mx.{op}(t{args[0]}, axis={list(args[1])})"
    if op in ("sum", "prod", "max", "min", "all", "any"):
        a, axes, keep = args
        return f"t{t} = mx.{op}(t{a}, axis={list(axes)}, keepdims={keep})"
    if op == "slice":
        a, start, stop, strides = args
        idx = ", ".join(f"{b}:{e}:{s}" for b, e, s in zip(start, stop, strides))
        return f"t{t} = t{a}[{idx}]"
    if op == "clip":
        return f"t{t} = mx.clip(t{args[0]}, t{args[1]}, t{args[2]})"
    if op == "take":
        # Emily's take clamps the indices into the axis (cpp/index.cc).
        a, i, axis = args
        return f"t{t} = mx.take(t{a}, mx.clip(t{i}, 0, {shape(a)[axis] - 1}), axis={axis})"
    if op == "argmax":
        a, axis, keep = args
        return f"t{t} = mx.argmax(t{a}, axis={axis}, keepdims={keep})"
    if op == "concatenate":
        return f"t{t} = mx.concatenate([{', '.join(f't{a}' for a in args[0])}], axis={args[1]})"
    raise NotImplementedError(f"no Python twin for instruction {op}")


def build(graph, inputs):
    """Straight-line source of the graph's function, its shapes found by building it once."""
    n = len(inputs)
    env = {"mx": mx, **{f"t{i}": x for i, x in enumerate(inputs)}}
    lines = []
    t = n
    for op, args in graph["instrs"]:
        line = statement(t, op, args, lambda slot: env[f"t{slot}"].shape,
                         lambda slot: env[f"t{slot}"].dtype)
        exec(line, env)  # lazily: only to learn the shapes later instructions need
        lines.append("    " + line)
        t += OUTPUTS.get(op, 1)
    outs = ", ".join(f"t{o}" for o in graph["outputs"])
    params = ", ".join(f"t{i}" for i in range(n))
    source = f"def graph({params}):\n" + "\n".join(lines) + f"\n    return ({outs},)\n"
    scope = {"mx": mx}
    exec(source, scope)
    return scope["graph"], source


def local(path, dump):
    """`path`, or the file of that name beside the dump once the dump has been moved."""
    if os.path.isdir(os.path.dirname(path) or "."):
        return path
    return os.path.join(os.path.dirname(os.path.abspath(dump)), os.path.basename(path))


def load(dump):
    """Each graph of the dump with its inputs, as `(graph, {label: run})`: `run` builds the
    graph eagerly (or through mx.compile), evaluates it and reads the results back."""
    with open(dump) as f:
        graphs = ast.literal_eval(f.read())
    mx.set_default_device(mx.cpu)
    for g in graphs:
        g["out"] = local(g["out"], dump)
        inputs = [mx.array(np.fromfile(local(path, dump), dtype=NP[d]).reshape(shape))
                  for path, shape, d in g["inputs"]]
        mx.eval(inputs)
        fun, source = build(g, inputs)
        if "--source" in sys.argv:
            print(source, file=sys.stderr)

        # Every output evaluated in one go, then read without a copy (Emily's reads do
        # not copy either): reading each with np.array would evaluate the outputs one
        # by one and copy them.
        def run(f, inputs=inputs):
            def go():
                ys = f(*inputs)
                mx.eval(ys)
                return [np.asarray(y) for y in ys]

            return go

        yield g, {"eager": run(fun), "compiled": run(mx.compile(fun))}


def serve(dump):
    """Timed windows on request, for a benchmark that alternates them with its own: reads
    `NAME REPS WARM` lines and answers each with the mean microseconds per run of REPS
    runs of that graph, after untimed runs for WARM milliseconds, once a `ready` line has
    said that every graph is built."""
    runs = {}
    for g, fns in load(dump):
        for label, f in fns.items():
            f()
            runs[f"{g['name']}_{label}"] = f
    serve_runs(runs)


def main():
    if "--serve" in sys.argv:
        return serve(sys.argv[1])
    for g, fns in load(sys.argv[1]):
        for label, f in fns.items():
            for i, y in enumerate(f()):
                y.tofile(f"{g['out']}_{label}_{i}.bin")
            print(f"{g['name']}_{label} {best(f, g['reps']):.3f}")


if __name__ == "__main__":
    main()
