#!/usr/bin/env python3
"""tools/trace_step.py on a synthetic trace: two replays of a three-kernel graph (its table's
numbers worked out by hand below), a kernel outside any graph, an incomplete third replay, and
malformed lines, which must be skipped and counted; then a trace with no graph at all, which
must fail with a clear message."""
import os
import subprocess
import sys
import tempfile

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "trace_step.py")


def run(text):
    with tempfile.NamedTemporaryFile("w", suffix=".tsv", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        return subprocess.run([sys.executable, TOOL, path, "--detail"], capture_output=True, text=True)
    finally:
        os.unlink(path)


def row(t0, t1, gid, node, name):
    return f"{t0}\t{t1}\t{gid}\t{node}\t4\t1\t1\t256\t{name}\n"


def check(cond, what, out):
    if not cond:
        sys.exit(f"FAIL: {what}\n--- output ---\n{out}")


# Replay r starts at 10 us · r: ka 0–1 us, kb 0.8–3 us (overlapping ka by 0.2), ka 2.9–5 us.
# adv: 1.0, 2.0, 2.0 us (span 5.0); gaps: 0, -0.2, -0.1; ka twice: adv 3.0 in all.
lines = [row(0, 100, 0, 0, "setup")]  # not in a graph: ignored
for r in range(2):
    b = 10000 * r
    lines += [row(b, b + 1000, 7, 10, "ka"), row(b + 800, b + 3000, 7, 11, "kb"),
              row(b + 2900, b + 5000, 7, 12, "ka")]
lines.append(row(20000, 21000, 7, 10, "ka"))  # a third replay cut short
lines += ["garbage\n", "1\t2\n", row(5, 4, 7, 10, "ka"), "x\t2\t7\t10\t4\t1\t1\t256\tka\n"]
p = run("".join(lines))
out = p.stdout + p.stderr
print(out)
check(p.returncode == 0, "exit status 0", out)
check("graph 7: 3 kernels, 2 replays, span median 5.0 us" in p.stdout, "span of 2 replays", out)
check("4 malformed lines skipped" in p.stderr, "malformed lines counted", out)
check("the last 1 left out" in p.stderr, "incomplete replay left out", out)
agg = {l.split()[0]: l.split()[1:] for l in p.stdout.splitlines() if l.startswith("  k")}
check(agg.get("ka") == ["2", "3.0", "1.50", "1.55"], "ka: 2 calls, adv 3.0, own 1.0 and 2.1 us", out)
check(agg.get("kb") == ["1", "2.0", "2.00", "2.20"], "kb: adv 2.0, own 2.2 us", out)
check(any(l.split()[1:] == ["kb", "4x1x1", "2.20", "2.00", "-0.20"] for l in p.stdout.splitlines()
          if l.strip().startswith("1 ")), "kb's detail row", out)

p = run(row(0, 100, 0, 0, "setup") + "garbage\n")
check(p.returncode != 0 and "no graph kernels in the trace" in p.stderr, "no graph: clear failure",
      p.stdout + p.stderr)
print("trace_step: all checks passed")
