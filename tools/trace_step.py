#!/usr/bin/env python3
"""Per-kernel table of a CUDA graph's replays from a bench/cupti_trace.c trace.

  tools/trace_step.py TRACE.tsv [--last N] [--detail]

For every graph in the trace (one per decode-step shape), the replays are cut out (each runs
every node once), and for the last N replays each kernel's median
  dur   its own time, first block start to last block end;
  adv   how far it moves the step's end: its end minus the latest end before it (the step's
        time is the sum of adv over its kernels, plus the first kernel's start);
  gap   its start minus its predecessor's end (negative: it overlapped its predecessor, PDL).
Kernels of the same name are summed per graph (count, adv total, adv per call).

With --eager GAP_US the kernels launched outside graphs (a prefill's forward calls) are cut into
calls where the device sat idle for more than GAP_US microseconds, and the last calls with as many
kernels as the last one are tabulated the same way, each call standing for a replay.
"""
import argparse
import collections
import gzip
import statistics
import subprocess
import sys


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.split("\n")
        return {n: out[i] for i, n in enumerate(names)}
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def short(name):
    s = name.split("(")[0]
    for p in ("void ", "duet__"):
        s = s.replace(p, "")
    return s[:60]


def eager_calls(ks, gap_ns):
    """The eager kernels ks as replays of one call: cut at idle gaps longer than gap_ns, the last
    calls with the last one's kernel count kept, each kernel's node = its index in its call."""
    ks.sort()
    calls, cur, end = [], [], None
    for k in ks:
        if cur and k[0] - end > gap_ns:
            calls.append(cur)
            cur = []
        end = k[1] if not cur else max(end, k[1])
        cur.append(k)
    calls.append(cur)
    n = len(calls[-1])
    same = [c for c in calls if len(c) == n]
    return [(k[0], k[1], i, k[3], k[4], k[5]) for c in same for i, k in enumerate(c)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--last", type=int, default=20, help="replays per graph to take medians over")
    ap.add_argument("--detail", action="store_true", help="print every kernel of the step too")
    ap.add_argument("--eager", type=float, metavar="GAP_US",
                    help="tabulate the kernels outside graphs instead, calls cut at idle gaps")
    a = ap.parse_args()
    graphs = collections.defaultdict(list)
    bad = 0
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt", errors="replace") as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            try:
                if len(p) != 9:
                    raise ValueError(line)
                t0, t1, gid, node, threads = int(p[0]), int(p[1]), int(p[2]), int(p[3]), int(p[7])
                grid = "x".join(str(int(v)) for v in p[4:7])
                if t1 < t0:
                    raise ValueError(line)
            except ValueError:
                bad += 1
                continue
            if (gid == 0) != (a.eager is not None):
                continue
            graphs[gid].append((t0, t1, node, grid, threads, p[8]))
    if bad:
        print(f"{a.trace}: {bad} malformed lines skipped", file=sys.stderr)
    if not graphs:
        sys.exit("no eager kernels in the trace" if a.eager is not None else
                 "no graph kernels in the trace")
    if a.eager is not None:
        graphs = {0: eager_calls(graphs[0], a.eager * 1e3)}
    names = demangle(sorted({k[5] for g in graphs.values() for k in g}))
    for gid, ks in sorted(graphs.items()):
        ks.sort()
        nodes = sorted({k[2] for k in ks})
        n = len(nodes)
        if len(ks) % n != 0:
            print(f"graph {gid}: {len(ks)} kernels is not a whole number of replays of {n}; "
                  f"the last {len(ks) % n} left out", file=sys.stderr)
        reps = [ks[i:i + n] for i in range(0, len(ks) - len(ks) % n, n)]
        reps = reps[-a.last:]
        order = [k[2] for k in reps[0]]
        per = collections.defaultdict(lambda: {"dur": [], "adv": [], "gap": []})
        spans = []
        for r in reps:
            by = {k[2]: k for k in r}
            if set(by) != set(order):
                continue
            latest = None
            prev_end = None
            first = min(k[0] for k in r)
            for node in order:
                t0, t1 = by[node][0], by[node][1]
                per[node]["dur"].append(t1 - t0)
                per[node]["adv"].append(t1 - (latest if latest is not None else first))
                per[node]["gap"].append(t0 - prev_end if prev_end is not None else 0)
                latest = t1 if latest is None else max(latest, t1)
                prev_end = t1
            spans.append(latest - first)
        if not spans:
            print(f"graph {gid}: no complete replay")
            continue
        med = lambda v: statistics.median(v) / 1e3  # noqa: E731  ns -> us
        info = {k[2]: k for k in reps[0]}
        print(f"graph {gid}: {n} kernels, {len(spans)} replays, span median {med(spans):.1f} us")
        agg = collections.OrderedDict()
        for node in order:
            nm = short(names[info[node][5]])
            d = agg.setdefault(nm, [0, 0.0, 0.0])
            d[0] += 1
            d[1] += med(per[node]["adv"])
            d[2] += med(per[node]["dur"])
        print(f"  {'kernel':60s} {'n':>4s} {'adv us':>9s} {'adv/call':>9s} {'dur/call':>9s}")
        for nm, (c, adv, dur) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"  {nm:60s} {c:4d} {adv:9.1f} {adv / c:9.2f} {dur / c:9.2f}")
        if a.detail:
            print(f"  {'#':>4s} {'kernel':60s} {'grid':>12s} {'dur':>7s} {'adv':>7s} {'gap':>7s}")
            for i, node in enumerate(order):
                k = info[node]
                print(f"  {i:4d} {short(names[k[5]]):60s} {k[3]:>12s} {med(per[node]['dur']):7.2f}"
                      f" {med(per[node]['adv']):7.2f} {med(per[node]['gap']):7.2f}")


if __name__ == "__main__":
    main()
