"""Where a decoding token's device time goes, from bench/gpu/cupti_times.cc's records.

    python3 bench/gpu/timeline.py /tmp/kernels.* [--marker=REGEX] [--top=25]

Each file is one process's kernels, copies and memsets on the device's clock. A
generation is a burst of device work (bursts part where the device idles more than
--burst-gap-ms); within one, a token ends with the greedy argmax's kernel (--marker: MLX's
arg_reduce or PyTorch's ArgMaxOps over a floating type; Bumblebee's stopping test takes
an argmax over booleans too), so the activities between two such kernels are one decoding
pass. The prompt's pass and the first token's are left out, as are bursts of fewer than
--min-passes passes (warm-ups).

Per process it prints, as medians over the passes: the period (from one argmax kernel's
end to the next's, the device's time per token), the device's busy time within it (the
union of its activities), the idle rest and how it splits into gaps between activities
(a gap of a few microseconds is a kernel's launch within a CUDA graph; a long one is the
device waiting for the host to launch the next graph), and the kernels a pass; where the
long gaps lie (the activities on each side, by their place in the pass); then the kernels
by name, each's count and time a pass.
"""

import argparse
import re
import statistics
import sys
from collections import defaultdict


def short_name(name, width=96):
    # Drop the parameter list (the first '(' outside template brackets).
    depth = 0
    for i, c in enumerate(name):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0 and i > 0:
            name = name[:i]
            break
    return name if len(name) <= width else name[: width - 3] + "..."


def load(path):
    header, acts = "", []
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("#"):
                header = header or line[1:].strip()
                continue
            parts = line.rstrip("\n").split("\t", 5)
            if len(parts) < 6:
                continue
            kind, start, end, _stream, graph, what = parts
            acts.append((int(start), int(end), kind, int(graph), what))
    acts.sort()
    return header, acts


def bursts(acts, gap_ns):
    out, current, last_end = [], [], 0
    for a in acts:
        if current and a[0] - last_end > gap_ns:
            out.append(current)
            current = []
        last_end = max(last_end, a[1]) if current else a[1]
        current.append(a)
    if current:
        out.append(current)
    return out


def passes(burst, marker):
    """The decoding passes of one burst: lists of activities between two marker kernels."""
    ends = [i for i, a in enumerate(burst) if a[2] == "k" and marker.search(a[4])]
    # ends[0] closes the prompt's pass, ends[1] the first token's: keep the rest.
    return [burst[ends[j - 1] + 1 : ends[j] + 1] for j in range(2, len(ends))], ends


def pass_figures(acts, window_start):
    window_end = acts[-1][1]
    busy, gaps, cursor, graph = 0, [], window_start, None
    for i, (start, end, _kind, g, _what) in enumerate(acts):
        start = max(start, window_start)
        if start > cursor:
            # (gap, whether it lies between two graphs' nodes or within one graph, the
            # index of the activity after it)
            gaps.append((start - cursor, g != graph or g == 0, i))
        if end > cursor:
            busy += end - max(start, cursor)
            cursor = end
        graph = g
    return window_end - window_start, busy, gaps


def report(path, args, marker):
    header, acts = load(path)
    if not acts:
        return
    print(f"\n## {header[:160]}\n")
    kept = []
    for burst in bursts(acts, args.burst_gap_ms * 1e6):
        ps, ends = passes(burst, marker)
        if not ps or len(ps) + 2 < args.min_passes:
            continue
        previous_end = burst[ends[1]][1]
        for p in ps:
            kept.append((previous_end, p))
            previous_end = p[-1][1]
    if not kept:
        print(
            f"no burst of {args.min_passes} or more passes (marker {marker.pattern!r})"
        )
        return
    periods, busies, idles, kernels, small, large, between, longest = (
        [] for _ in range(8)
    )
    by_name = defaultdict(lambda: [0, 0])
    long_gaps = defaultdict(list)
    for start, p in kept:
        period, busy, gaps = pass_figures(p, start)
        periods.append(period)
        busies.append(busy)
        idles.append(period - busy)
        kernels.append(sum(1 for a in p if a[2] == "k"))
        small.append(sum(g for g, _, _ in gaps if g < args.launch_gap_us * 1e3))
        large.append(sum(g for g, _, _ in gaps if g >= args.launch_gap_us * 1e3))
        between.append(sum(g for g, outside, _ in gaps if outside))
        longest.append(max((g for g, _, _ in gaps), default=0))
        for g, _, i in gaps:
            if g >= args.launch_gap_us * 1e3:
                previous = short_name(p[i - 1][4], 40) if i else "(the pass's start)"
                long_gaps[(i, short_name(p[i][4], 40), previous)].append(g)
        for a in p:
            key = (
                short_name(a[4])
                if a[2] == "k"
                else {"c": "(copy)", "s": "(memset)"}[a[2]]
            )
            by_name[key][0] += 1
            by_name[key][1] += a[1] - a[0]
    n = len(kept)

    def med(xs):
        return statistics.median(xs) / 1e3

    print(f"{n} decoding passes; medians a pass (us):\n")
    gap = args.launch_gap_us
    print(
        f"| period | busy | idle | in gaps < {gap:g} us | in gaps >= {gap:g} us "
        "| between graphs | longest gap | kernels |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {med(periods):.1f} | {med(busies):.1f} | {med(idles):.1f} | {med(small):.1f} | "
        f"{med(large):.1f} | {med(between):.1f} | {med(longest):.1f} | "
        f"{statistics.median(kernels):.0f} |"
    )
    print(f"\nwhere the gaps of {gap:g} us or more lie (by the activity's index in the pass):\n")
    print("| the activity after the gap (index: name) | the one before | passes with it | median us | us a pass |")
    print("|---|---|---|---|---|")
    spots = sorted(long_gaps.items(), key=lambda kv: -sum(kv[1]))
    for (i, name, previous), gs in spots[:8]:
        print(
            f"| {i}: {name} | {previous} | {len(gs)} | {statistics.median(gs) / 1e3:.1f} "
            f"| {sum(gs) / n / 1e3:.1f} |"
        )
    total = sum(t for _, t in by_name.values())
    print(f"\nby name, a pass (of {total / n / 1e3:.1f} us of activity):\n")
    print("| name | count | us each | us a pass | share |")
    print("|---|---|---|---|---|")
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    for name, (count, t) in rows[: args.top]:
        print(
            f"| {name} | {count / n:.1f} | {t / count / 1e3:.2f} | {t / n / 1e3:.1f} "
            f"| {t / total:.1%} |"
        )
    rest = rows[args.top :]
    if rest:
        count = sum(c for _, (c, _) in rest)
        t = sum(t for _, (_, t) in rest)
        print(
            f"| ({len(rest)} other names) | {count / n:.1f} | | {t / n / 1e3:.1f} | {t / total:.1%} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument(
        "--marker",
        default=r"arg_reduce\w*<(?!bool)|ArgMaxOps<(?!bool)",
        help="a regular expression matching a token's last kernel",
    )
    parser.add_argument("--burst-gap-ms", type=float, default=20.0)
    parser.add_argument("--min-passes", type=int, default=8)
    parser.add_argument("--launch-gap-us", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    marker = re.compile(args.marker)
    for path in args.files:
        report(path, args, marker)


if __name__ == "__main__":
    sys.exit(main())
