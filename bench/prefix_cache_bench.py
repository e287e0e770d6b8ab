#!/usr/bin/env python3
"""Multi-turn chat through the local cluster, the context worker's prefix cache off and on.

One run starts the cluster twice on the demo model (duet-router, one duet-ctx, one duet-gen, CPU;
tests/integration/duet_cluster.py), the second time with --cache.prefix, and sends the same
workload to both: CONVS conversations of TURNS turns, each prompt a shared system prompt of SYSTEM
tokens (corpus text as byte ids), the conversation so far (every earlier user message and
answer) and a new user message of USER tokens; greedy, max_tokens ANSWER, streamed, one request
at a time. Prints per mode: mean and p50 / p90 TTFT (first streamed chunk), the prompt tokens
the context worker prefilled (its duet_worker_prefill_tokens_total), the prefix cache's hits and
tokens saved, requests/s, and whether every answer is the same in both modes.

With --ctx N (N >= 2) the cluster has N context workers placed round robin and a third mode
runs: the cache on without placement.prefix_aware (the router's placement by cached prefix off),
against the cache on with it.

Usage: bench/prefix_cache_bench.py [BUILD_DIR [MODEL_DIR]] [--convs N] [--turns N]
       [--system N] [--user N] [--answer N] [--ctx N]
       (defaults: build models/duet-demo 4 8 2048 64 16 1)
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
from duet_cluster import cluster, free_port, served_model  # noqa: E402


def metrics(port):
    out = {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("duet_worker_") and " " in line and "{" not in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def stream(port, model, ids, answer):
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": answer, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text = None, ""
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            ch = json.loads(line[6:])["choices"]
            if ch:
                text += ch[0]["text"]
    return ttft, text


def run(args, build, model_dir, cache, prefix_aware):
    corpus = open(os.path.join(HERE, "..", "data", "corpus", "web-plain.txt"), "rb").read()
    system = [256] + list(corpus[:args.system - 1])
    tmp = tempfile.mkdtemp(prefix="duet-prefix-bench-")
    mps = [free_port() for _ in range(args.ctx)]
    workers = []
    for i, mp in enumerate(mps):
        extra = ["--metrics.port", str(mp), "--cache.kv_pages", "4096"]
        if cache:
            extra += ["--cache.prefix", "--cache.prefix_snapshots", "64",
                      "--cache.prefix_state_every", "8"]
        workers.append((f"ctx-{i}", "ctx", extra))
    workers.append(("gen-0", "gen", ["--cache.kv_pages", "1024"]))
    ttfts, answers = [], []
    router_args = ["--placement.local_prefill_tokens", "16", "--placement.policy", "round_robin",
                   "--placement.prefix_aware" if prefix_aware else "--no-placement.prefix_aware"]
    with cluster(build, model_dir, tmp, workers, router_args=router_args) as hp:
        model = served_model(hp)

        def metrics_all():  # the context workers' counters, summed
            out = {}
            for mp in mps:
                for k, v in metrics(mp).items():
                    out[k] = out.get(k, 0) + v
            return out
        before = metrics_all()
        t0 = time.perf_counter()
        for c in range(args.convs):
            history = []
            for t in range(args.turns):
                off = (c * args.turns + t) * args.user
                user = list(corpus[args.system + off:args.system + off + args.user])
                ids = system + history + user
                ttft, text = stream(hp, model, ids, args.answer)
                ttfts.append(ttft)
                answers.append(text)
                history += user + list(text.encode())
        wall = time.perf_counter() - t0
        time.sleep(0.3)
        after = metrics_all()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {"ttft": ttfts, "answers": answers, "wall": wall,
            "prefill": d.get("duet_worker_prefill_tokens_total", 0),
            "hits": d.get("duet_worker_prefix_cache_hits_total", 0),
            "saved": d.get("duet_worker_prefix_cache_tokens_saved_total", 0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build", nargs="?", default="build")
    ap.add_argument("model", nargs="?", default="models/duet-demo")
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=1,
                    help="context workers; with 2 or more, a third mode: the cache on, placed "
                         "round robin without placement.prefix_aware")
    args = ap.parse_args()
    res = {}
    modes = [("off", False, True), ("on", True, True)]
    if args.ctx > 1:
        modes.append(("on, round robin", True, False))
    for name, cache, aware in modes:
        print(f"prefix cache {name}: {args.convs} conversations x {args.turns} turns, "
              f"{args.ctx} context worker(s) ...", file=sys.stderr, flush=True)
        res[name] = run(args, args.build, args.model, cache, aware)
    n = args.convs * args.turns
    print(f"| prefix cache | TTFT mean ms | p50 ms | p90 ms | prompt tokens prefilled | hits | "
          f"tokens saved | requests/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, _, _ in modes:
        r = res[name]
        t = sorted(r["ttft"])
        print(f"| {name} | {statistics.mean(t) * 1e3:.1f} | {t[len(t) // 2] * 1e3:.1f} | "
              f"{t[int(len(t) * 0.9)] * 1e3:.1f} | {int(r['prefill']):,} | {int(r['hits'])} | "
              f"{int(r['saved']):,} | {n / r['wall']:.2f} |")
    same = all(res[name]["answers"] == res["off"]["answers"] for name, _, _ in modes)
    print(f"\nanswers identical in every mode: {same}; TTFT ratio off/on (mean): "
          f"{statistics.mean(res['off']['ttft']) / statistics.mean(res['on']['ttft']):.2f}x")
    return 0 if same else 1


sys.exit(main())
