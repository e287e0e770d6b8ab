"""The context worker's prefix cache (cache.prefix, worker/prefix_cache.h) through a real cluster.

Starts duet-router, one duet-ctx with the prefix cache on (few snapshots, a small page pool, its
worker /metrics) and one duet-gen on the demo model (CPU, f32; every prompt here is prefilled by
the context worker), then sends greedy completions over token ids in an order that makes each
case happen:
  - a prompt, then the same prompt again (a hit: all its cached chunks), a longer prompt that
    starts with it (a later turn of a chat: a hit), a prompt sharing only its first chunks (a
    shorter hit), prompts sharing nothing (misses), prompts that fill the page pool (the cache
    gives pages back: evictions), and the first prompt once more;
  - every answer equals duet-generate's for the same ids (the reference: a prefill from the
    start), hit or miss;
  - the worker's /metrics: lookups, hits, tokens saved and evictions as this order implies
    (hits at least 3, tokens saved at least 3 chunks' worth, evictions at least 1);
  - at the end, with no request running, the pool's free pages plus the pages only the cache
    holds make the whole pool (nothing leaked), read from the worker's own figures.
Then eviction while a transfer is in flight: a second cluster whose context worker holds every
transfer 2 s after its prefill (test.xfer_hold_ms) over a pool too small for two prompts at once.
A prompt's transfer is held while a second prompt needs pages: the cache gives up the entries it
made of the first (they share its pages) but those pages stay the first request's until its
transfer ends, so the second waits for them; both answers equal duet-generate's, the evictions
show, and the pool is whole at the end.

Usage: prefix_cache_cluster_test.py BUILD_DIR MODEL_DIR
"""
import os
import re
import sys
import tempfile
import time
import urllib.request

from duet_cluster import check, CHUNK, cluster, failures, finish, free_port, generate, served_model




BUILD, MODEL = sys.argv[1], sys.argv[2]
PAGES = 48  # pages of 16 tokens: 768 tokens


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(duet_worker_[a-z_]+) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def completion(port, model, ids):
    import json
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 6, "temperature": 0})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def text_ids(text):
    return [256] + list(text.encode())


def main():
    tmp = tempfile.mkdtemp(prefix="duet-prefix-")
    mp = free_port()
    base = text_ids("In the beginning God created the heaven and the earth. And the earth was "
                    "without form, and void; and darkness was upon the face of the deep. And "
                    "the Spirit of God moved upon the face of the waters. And God said, Let there "
                    "be light: and there was light.")
    more = list(" And God saw the light, that it was good: and God divided the light from the "
                "darkness. And God called the light Day.".encode())
    other = text_ids("Call me Ishmael. Some years ago, never mind how long precisely, having "
                     "little or no money in my purse, and nothing particular to interest me on "
                     "shore, I thought I would sail about a little and see the watery part of the "
                     "world.")
    big = text_ids(("It was the best of times, it was the worst of times, it was the age of "
                    "wisdom, it was the age of foolishness, ") * 5)
    prompts = [("first", base), ("same again", base), ("next turn", base + more),
               ("shares its first chunks", base[:150] + list(b" and then something else")),
               ("unrelated", other), ("fills the pool", big), ("first once more", base)]
    workers = [("ctx-0", "ctx", ["--cache.prefix", "--cache.prefix_snapshots", "6",
                                 "--cache.kv_pages", str(PAGES), "--metrics.port", str(mp)]),
               ("gen-0", "gen", [])]
    with cluster(BUILD, MODEL, tmp, workers, router_args=["--placement.local_prefill_tokens",
                                                          "16"]) as hp:
        model = served_model(hp)
        for what, ids in prompts:
            got = completion(hp, model, ids)
            want = generate(BUILD, MODEL, ids, 6)["text"]
            check(got == want, f"{what} ({len(ids)} tokens): {got!r}, duet-generate {want!r}")
            print(f"{what}: {len(ids)} tokens -> {got!r}", flush=True)
        time.sleep(0.3)  # a heartbeat carries the last counters
        m = metrics(mp)
        print({k: v for k, v in m.items() if "prefix" in k or "kv_pages" in k}, flush=True)
        check(m.get("duet_worker_prefix_cache_lookups_total") == len(prompts),
              f"lookups {m.get('duet_worker_prefix_cache_lookups_total')}")
        check(m.get("duet_worker_prefix_cache_hits_total", 0) >= 3, "fewer than 3 hits")
        check(m.get("duet_worker_prefix_cache_tokens_saved_total", 0) >= 3 * int(CHUNK),
              "fewer tokens saved than three chunks")
        check(m.get("duet_worker_prefix_cache_evictions_total", 0) >= 1,
              "the full pool evicted nothing")
        check(0 < m.get("duet_worker_prefix_cache_entries", 0) <= 6, "entries out of bounds")
        free = m.get("duet_worker_kv_pages_free", -1)
        held = m.get("duet_worker_prefix_cache_pages", -1)
        check(0 < held and free + held == PAGES,
              f"idle: {free} pages free + {held} held by the cache != the pool's {PAGES}")
    in_flight_eviction(tmp)
    finish("prefix_cache_cluster", failures, tmp)


def in_flight_eviction(tmp):
    import threading
    pages = 40  # 640 tokens: the two prompts below need 57 pages together
    mp = free_port()
    first = text_ids("In the beginning God created the heaven and the earth. And the earth was "
                     "without form, and void; and darkness was upon the face of the deep. And "
                     "the Spirit of God moved upon the face of the waters. And God said, Let "
                     "there be light: and there was light. And God saw the light, that it was "
                     "good: and God divided the light from the darkness. And God called the "
                     "light Day, and the darkness he called Night.")
    second = text_ids(("It was the best of times, it was the worst of times, it was the age of "
                       "wisdom, it was the age of foolishness, ") * 5)
    check(len(first) // 16 + 1 + len(second) // 16 + 1 > pages, "the prompts fit together")
    workers = [("ctx-0", "ctx", ["--cache.prefix", "--cache.kv_pages", str(pages),
                                 "--test.xfer_hold_ms", "2000", "--metrics.port", str(mp)]),
               ("gen-0", "gen", [])]
    os.makedirs(f"{tmp}/in-flight")
    with cluster(BUILD, MODEL, f"{tmp}/in-flight", workers,
                 router_args=["--placement.local_prefill_tokens", "16"]) as hp:
        model = served_model(hp)
        got = {}

        def ask(name, ids):
            got[name] = completion(hp, model, ids)
        t = threading.Thread(target=ask, args=("first", first))
        t.start()
        time.sleep(0.8)  # its prefill is done, its entries made, its transfer held
        ask("second", second)
        t.join()
        for name, ids in (("first", first), ("second", second)):
            want = generate(BUILD, MODEL, ids, 6)["text"]
            check(got.get(name) == want,
                  f"in flight: {name} ({len(ids)} tokens): {got.get(name)!r}, "
                  f"duet-generate {want!r}")
        time.sleep(0.3)
        m = metrics(mp)
        print("in flight:", {k: v for k, v in m.items() if "prefix" in k or "kv_pages" in k},
              flush=True)
        check(m.get("duet_worker_prefix_cache_evictions_total", 0) >= 1,
              "in flight: the second prompt evicted nothing")
        free = m.get("duet_worker_kv_pages_free", -1)
        held = m.get("duet_worker_prefix_cache_pages", -1)
        check(free + held == pages,
              f"in flight, idle: {free} pages free + {held} held by the cache != {pages}")


main()
