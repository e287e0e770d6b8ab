"""The router's placement by cached prefix (placement.prefix_aware) through a real cluster.

Starts duet-router (placement.policy round_robin), two duet-ctx with the prefix cache on (their
worker /metrics) and one duet-gen on the demo model, and plays three multi-turn conversations,
each with its own long system prompt, each turn's prompt the previous one plus a new user part
(over 64 tokens: the turn before leaves a cached prefix at a prefill chunk end). Turns go round
the conversations (A1 B1 C1 A2 B2 C2 ...), so that with an odd number of conversations round
robin alone sends every conversation's next turn to the other context worker. Between turns the
test waits for heartbeats (3 x heartbeat_ms), so that the router knows the workers' summaries.

  - prefix_aware on: every turn after a conversation's first lands on the worker holding its
    conversation, so the two workers' prefix hits (duet_worker_prefix_cache_hits_total) sum to
    the number of later turns, and so does the router's duet_router_prefix_placements_total
    {role="ctx"};
  - prefix_aware off: the same traffic gets strictly fewer hits (a turn lands where the
    conversation was two turns before at best), and the router counts no such placement;
  - every answer, either way, equals duet-generate's for the same ids (a prefill from the start);
  - the router's duet_router_prefix_* counters and gauges equal the sums of the workers' own, and
    duet-bench's prefix figures over a run equal the router's deltas around it.

Usage: prefix_placement_cluster_test.py BUILD_DIR MODEL_DIR
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from duet_cluster import check, cluster, failures, finish, free_port, generate, served_model




BUILD, MODEL = sys.argv[1], sys.argv[2]
HEARTBEAT_S = 0.1  # duet_cluster's --heartbeat_ms
MAX_TOKENS = 6


def scrape(port, pattern):
    """{name or name{labels}: value} of the /metrics lines on port whose name matches pattern."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(" + pattern + r"(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def completion(port, model, ids):
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def conversations():
    """Three conversations: each a list of turns' prompts (token ids), each extending the last."""
    systems = [
        "Alpha desk. You answer questions about tides, harbours and the moon's pull on the sea; "
        "keep every answer short, cite the almanac, and never guess a time you cannot derive.",
        "Bravo line: a librarian who sorts old atlases by the year their coastlines were drawn, "
        "who speaks in lists and who asks for the shelf mark before anything else at all.",
        "Charlie unit, cooking assistant for a mountain hut: recipes for eight, a wood stove, "
        "no fresh milk after Tuesday, and snow water that must be boiled before it is used.",
    ]
    users = [" User: what should I know first, in one line, before we begin today?",
             " User: and what comes after that, if the weather turns during the afternoon?",
             " User: give me the one thing people usually forget, and why they forget it."]
    convs = []
    for s in systems:
        ids = [256] + list(s.encode())
        turns = []
        for u in users:
            ids = ids + list(u.encode())
            turns.append(ids)
        convs.append(turns)
    return convs


def bench(port, tmp):
    """duet-bench's prefix figures over a run of one prompt repeated equal the deltas of the
    router's counters around it, and its end occupancy the router's gauges."""
    prompts = f"{tmp}/prompts.jsonl"
    with open(prompts, "w") as f:
        f.write(json.dumps({"prompt": "Delta station. " * 40}) + "\n")
    before = scrape(port, "duet_router_prefix_[a-z_]+")
    out = f"{tmp}/bench.json"
    subprocess.run([f"{BUILD}/bench/duet-bench", "--url", f"http://127.0.0.1:{port}",
                    "--prompts", prompts, "--num-prompts", "6", "--max-tokens", "2",
                    "--metrics-settle-ms", "500", "--json", out],
                   check=True, capture_output=True, timeout=300)
    after = scrape(port, "duet_router_prefix_[a-z_]+")
    with open(out) as f:
        res = json.load(f)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    lookups = d.get("duet_router_prefix_lookups_total", 0)
    check(lookups == 6, f"bench: the router counted {lookups} lookups for 6 prompts")
    want = d.get("duet_router_prefix_hits_total", 0) / lookups if lookups else None
    got = res.get("prefix_hit_rate")
    check(got is not None and want is not None and abs(got - want) < 1e-9,  # JSON: 10 digits
          f"bench: prefix_hit_rate {res.get('prefix_hit_rate')}, the router's deltas {want}")
    check(res.get("prefix_tokens_saved") == d.get("duet_router_prefix_tokens_saved_total"),
          f"bench: prefix_tokens_saved {res.get('prefix_tokens_saved')}, router "
          f"{d.get('duet_router_prefix_tokens_saved_total')}")
    check(res.get("prefix_cache_pages") == after.get("duet_router_prefix_cache_pages"),
          f"bench: prefix_cache_pages {res.get('prefix_cache_pages')}, router "
          f"{after.get('duet_router_prefix_cache_pages')}")
    print(f"duet-bench: prefix_hit_rate {res.get('prefix_hit_rate')}, tokens saved "
          f"{res.get('prefix_tokens_saved')}, pages {res.get('prefix_cache_pages')}", flush=True)


def run(prefix_aware, convs, reference, tmp):
    """One cluster (logs in tmp), the traffic, and its figures: (hits summed over the ctx
    workers, lookups, the router's ctx and gen prefix placements)."""
    os.makedirs(tmp)
    mports = [free_port(), free_port()]
    ctx_args = ["--cache.prefix", "--cache.prefix_snapshots", "64", "--cache.prefix_state_every",
                "4"]
    workers = [("ctx-0", "ctx", ctx_args + ["--metrics.port", str(mports[0])]),
               ("ctx-1", "ctx", ctx_args + ["--metrics.port", str(mports[1])]),
               ("gen-0", "gen", [])]
    router_args = ["--placement.policy", "round_robin",
                   "--placement.prefix_aware" if prefix_aware else "--no-placement.prefix_aware"]
    label = f"prefix_aware {'on' if prefix_aware else 'off'}"
    with cluster(BUILD, MODEL, tmp, workers, router_args=router_args) as hp:
        model = served_model(hp)
        for t in range(len(convs[0])):
            for c, turns in enumerate(convs):
                ids = turns[t]
                got = completion(hp, model, ids)
                check(got == reference[(c, t)],
                      f"{label}: conversation {c} turn {t} ({len(ids)} tokens): {got!r}, "
                      f"duet-generate {reference[(c, t)]!r}")
                time.sleep(3 * HEARTBEAT_S)  # the worker's summary reaches the router
        per = [scrape(p, "duet_worker_prefix_cache_[a-z_]+") for p in mports]
        rt = scrape(hp, "duet_router_prefix_placements_total")
        print(f"{label}: workers {per}, router {rt}", flush=True)
        # the router's sums of the workers' heartbeats equal their own /metrics
        agg = scrape(hp, "duet_router_prefix_[a-z_]+")
        for name in ("lookups", "hits", "tokens_saved", "evictions"):
            mine = sum(m.get(f"duet_worker_prefix_cache_{name}_total", 0) for m in per)
            check(agg.get(f"duet_router_prefix_{name}_total") == mine,
                  f"{label}: router's duet_router_prefix_{name}_total "
                  f"{agg.get(f'duet_router_prefix_{name}_total')}, the workers' {mine}")
        for name in ("entries", "pages"):
            mine = sum(m.get(f"duet_worker_prefix_cache_{name}", 0) for m in per)
            check(agg.get(f"duet_router_prefix_cache_{name}") == mine,
                  f"{label}: router's duet_router_prefix_cache_{name} "
                  f"{agg.get(f'duet_router_prefix_cache_{name}')}, the workers' {mine}")
        if prefix_aware:
            bench(hp, tmp)
    hits = sum(m.get("duet_worker_prefix_cache_hits_total", 0) for m in per)
    lookups = sum(m.get("duet_worker_prefix_cache_lookups_total", 0) for m in per)
    return (hits, lookups, rt.get('duet_router_prefix_placements_total{role="ctx"}', -1),
            rt.get('duet_router_prefix_placements_total{role="gen"}', -1))


def main():
    tmp = tempfile.mkdtemp(prefix="duet-placement-")
    convs = conversations()
    reference = {(c, t): generate(BUILD, MODEL, ids, MAX_TOKENS)["text"]
                 for c, turns in enumerate(convs) for t, ids in enumerate(turns)}
    prompts = sum(len(turns) for turns in convs)
    later = prompts - len(convs)  # turns after a conversation's first
    hits, lookups, ctx_placed, gen_placed = run(True, convs, reference, f"{tmp}/on")
    check(lookups == prompts, f"on: {lookups} lookups, {prompts} prompts")
    check(hits == later, f"on: {hits} prefix hits, want one per later turn ({later})")
    check(ctx_placed == later, f"on: router placed {ctx_placed} by a cached prefix, want {later}")
    check(gen_placed == 0, f"on: {gen_placed} gen placements by a cached prefix (no gen cache)")
    hits_off, lookups_off, ctx_off, _ = run(False, convs, reference, f"{tmp}/off")
    check(lookups_off == prompts, f"off: {lookups_off} lookups, {prompts} prompts")
    check(hits_off < hits, f"off: {hits_off} prefix hits, not fewer than on's {hits}")
    check(ctx_off == 0, f"off: router placed {ctx_off} by a cached prefix")
    print(f"hits: {hits} with prefix_aware, {hits_off} without ({later} later turns)", flush=True)
    finish("prefix_placement_cluster", failures, tmp)


main()
