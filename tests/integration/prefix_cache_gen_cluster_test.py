"""The generation worker's prefix cache (cache.prefix on duet-gen) through a real cluster.

Starts duet-router with placement.local_prefill_tokens above every prompt here (so each one is
prefilled on the generation worker: a Generate) and one duet-gen on the demo model (CPU, f32)
with the prefix cache on, a small page pool and its worker /metrics. Greedy completions over
token ids, each answer compared with duet-generate's for the same ids (the reference: a prefill
from the start, then plain decoding):
  (a) a prompt, the same prompt again, a prompt sharing its first chunks: hits at prefill chunk
      ends, answers equal;
  (b) a next turn: turn 2's prompt is turn 1's prompt ids, turn 1's generated ids and new ids. It
      resumes from the entry kept while turn 1 decoded (the newest page-grid length its sequence
      reached: exactly that many tokens saved), and its answer equals duet-generate's for the
      whole prompt. That entry's KDA state is decode's (token by token), a prefill's only to float
      rounding (docs/architecture.md, "Prefix cache"; test_worker_prefix_cache measures it): the
      demo model's greedy answer does not change;
  (c) page pressure: distinct prompts, four at once, in a pool that cannot keep all their entries:
      evictions, every answer equal;
  (d) a request cancelled while its prompt is prefilled (the client closes the stream): the same
      prompt afterwards saves no more tokens than the chunks finished before the cancel (read
      from the worker's log) and answers as duet-generate;
  and at the end, with nothing running, the pool's free pages plus the pages only the cache holds
  make the whole pool (nothing leaked, nothing freed twice);
  (e) a second worker speculating (spec.method ngram): a decode entry is kept only when a step
      lands on the page grid, accepted rows folded in first; repetitive prompts (drafts accepted),
      their next turns and repeats answer as duet-generate without speculation;
  (f) with a context worker beside it (placement.local_prefill_tokens 200): short prompts fill the
      generation worker's cache, then long ones arrive transferred (a Reserve for their pages):
      the cache gives pages back for the reservations, answers equal, the pool whole at the end.

Usage: prefix_cache_gen_cluster_test.py BUILD_DIR MODEL_DIR
"""
import http.client
import json
import re
import sys
import tempfile
import threading
import time
import urllib.request

from duet_cluster import check, CHUNK, cluster, failures, finish, free_port, generate, served_model




BUILD, MODEL = sys.argv[1], sys.argv[2]
PAGES = 72  # pages of 16 tokens (duet_cluster's page size): 1152 tokens
PT = 16
MAX = 40  # tokens per answer: turn 1 decodes past two page boundaries


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(duet_worker_[a-z_]+) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def settled(port):
    time.sleep(0.3)  # a heartbeat carries the last counters
    return metrics(port)


def completion(port, model, ids, max_tokens=MAX):
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def text_ids(text):
    return [256] + list(text.encode())


def expect(port, model, what, ids, max_tokens=MAX):
    got = completion(port, model, ids, max_tokens)
    want = generate(BUILD, MODEL, ids, max_tokens)
    check(got == want["text"], f"{what} ({len(ids)} tokens): {got!r}, duet-generate "
          f"{want['text']!r}")
    print(f"{what}: {len(ids)} tokens -> {got!r}", flush=True)
    return want


def main():
    tmp = tempfile.mkdtemp(prefix="duet-prefix-gen-")
    mp = free_port()
    base = text_ids("In the beginning God created the heaven and the earth. And the earth was "
                    "without form, and void; and darkness was upon the face of the deep. And "
                    "the Spirit of God moved upon the face of the waters. And God said, Let there "
                    "be light: and there was light.")
    others = [text_ids(t) for t in (
        "Call me Ishmael. Some years ago, never mind how long precisely, having little or no "
        "money in my purse, and nothing particular to interest me on shore, I thought I would "
        "sail about a little and see the watery part of the world.",
        "It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. However little known the feelings or views of such "
        "a man may be on his first entering a neighbourhood, this truth is so well fixed.",
        "Happy families are all alike; every unhappy family is unhappy in its own way. "
        "Everything was in confusion in the Oblonskys' house. The wife had discovered that the "
        "husband was carrying on an intrigue with a French girl.",
        "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, "
        "his chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly "
        "through the glass doors of Victory Mansions.")]
    # more snapshots than these prompts make: every eviction is the pool's (page pressure)
    workers = [("gen-0", "gen", ["--cache.prefix", "--cache.prefix_snapshots", "64",
                                 "--cache.kv_pages", str(PAGES), "--metrics.port", str(mp)])]
    with cluster(BUILD, MODEL, tmp, workers, log_level="debug",
                 router_args=["--placement.local_prefill_tokens", "100000"]) as hp:
        model = served_model(hp)
        # (a) prefill chunk ends
        expect(hp, model, "first", base)
        m0 = settled(mp)
        expect(hp, model, "same again", base)
        expect(hp, model, "shares its first chunks", base[:150] + list(b" and then otherwise"))
        m1 = settled(mp)
        check(m1.get("duet_worker_prefix_cache_hits_total", 0) -
              m0.get("duet_worker_prefix_cache_hits_total", 0) == 2,
              "(a): the same prompt and a shared prefix are not two hits")
        # (b) the next turn resumes from what turn 1's decoding kept
        t1 = expect(hp, model, "turn 1", others[0])
        m2 = settled(mp)
        turn2 = others[0] + t1["tokens"] + list(b" And then?")
        held = len(others[0]) + len(t1["tokens"]) - 1  # the newest id is never fed
        kept = held // PT * PT
        check(t1["finish_reason"] == "length" and kept > len(others[0]),
              f"turn 1 did not decode past a page boundary ({len(others[0])} + "
              f"{len(t1['tokens'])} tokens)")
        expect(hp, model, "turn 2 (turn 1's ids + new ones)", turn2)
        m3 = settled(mp)
        saved = (m3.get("duet_worker_prefix_cache_tokens_saved_total", 0) -
                 m2.get("duet_worker_prefix_cache_tokens_saved_total", 0))
        check(saved == kept, f"(b): turn 2 saved {saved} tokens, want {kept} (the entry turn 1's "
              "decoding kept)")
        # (c) pressure: four distinct prompts at once, then each again
        answers, threads = {}, []
        for i, ids in enumerate(others[1:] + [base + list(b" Then what?")]):
            def run(i=i, ids=ids):
                try:
                    answers[i] = (ids, completion(hp, model, ids))
                except OSError as e:
                    answers[i] = (ids, f"error: {e}")
            threads.append(threading.Thread(target=run))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, (ids, got) in sorted(answers.items()):
            want = generate(BUILD, MODEL, ids, MAX)["text"]
            check(got == want, f"(c) concurrent {i}: {got!r}, duet-generate {want!r}")
        for i, ids in enumerate(others[1:]):
            expect(hp, model, f"(c) again {i}", ids)
        m4 = settled(mp)
        check(m4.get("duet_worker_prefix_cache_evictions_total", 0) >= 1,
              "(c): the full pool evicted nothing")
        # (d) cancelled while prefilling: a long prompt, the stream closed at once
        long_ids = text_ids(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog."
                                     for i in range(12)))
        body = json.dumps({"model": model, "prompt": long_ids, "max_tokens": 4,
                           "temperature": 0, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", hp, timeout=30)
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        time.sleep(0.05)
        conn.sock.close()  # the client goes away mid-request
        conn.close()
        time.sleep(1.0)
        m5 = settled(mp)
        log = open(f"{tmp}/gen-0.log").read()
        cut = re.findall(r"cancelled at (\d+) of (\d+) prompt tokens prefilled", log)
        print(f"(d) cancels seen: {cut}", flush=True)
        expect(hp, model, "(d) the cancelled prompt again", long_ids, 4)
        m6 = settled(mp)
        saved = (m6.get("duet_worker_prefix_cache_tokens_saved_total", 0) -
                 m5.get("duet_worker_prefix_cache_tokens_saved_total", 0))
        if cut:
            done = int(cut[-1][0])
            check(saved <= done // int(CHUNK) * int(CHUNK),
                  f"(d): {saved} tokens saved after a cancel at {done} prefilled")
            print(f"(d): cancelled at {done} of {cut[-1][1]} prompt tokens; the retry saved "
                  f"{saved}", flush=True)
        else:
            print("(d): the request ended before the cancel reached the worker", flush=True)
        # nothing leaked
        m = settled(mp)
        print({k: v for k, v in m.items() if "prefix" in k or "kv_pages" in k}, flush=True)
        check(m.get("duet_worker_running", -1) == 0, "requests still running")
        free = m.get("duet_worker_kv_pages_free", -1)
        held = m.get("duet_worker_prefix_cache_pages", -1)
        check(0 < held and free + held == PAGES,
              f"idle: {free} pages free + {held} held by the cache != the pool's {PAGES}")
        check(0 < m.get("duet_worker_prefix_cache_entries", 0) <= 64, "entries out of bounds")
    # (e) speculation: verify steps of several tokens, replay rows folded in before a keep
    workers = [("gen-spec", "gen", ["--cache.prefix", "--cache.prefix_snapshots", "64",
                                    "--spec.method", "ngram", "--spec.k", "3",
                                    "--metrics.port", str(mp)])]
    with cluster(BUILD, MODEL, tmp, workers,
                 router_args=["--placement.local_prefill_tokens", "100000"]) as hp:
        model = served_model(hp)
        for i, text in enumerate(("the cat sat on the mat and the dog sat on the log. ",
                                  "one two three four five six seven eight nine ten. ")):
            ids = text_ids(text * 6)
            t1 = expect(hp, model, f"(e) spec turn 1 #{i}", ids)
            expect(hp, model, f"(e) spec turn 2 #{i}", ids + t1["tokens"] + list(text.encode()))
            expect(hp, model, f"(e) spec turn 1 again #{i}", ids)
        m = settled(mp)
        print({k: v for k, v in m.items() if "prefix" in k or "spec" in k}, flush=True)
        check(m.get("duet_worker_prefix_cache_hits_total", 0) >= 2, "(e): fewer than 2 hits")
    # (f) reservations for transferred prompts take their pages from the cache
    pages = 40
    workers = [("ctx-f", "ctx", []),
               ("gen-f", "gen", ["--cache.prefix", "--cache.prefix_snapshots", "64",
                                 "--cache.kv_pages", str(pages), "--metrics.port", str(mp)])]
    with cluster(BUILD, MODEL, tmp, workers,
                 router_args=["--placement.local_prefill_tokens", "200"]) as hp:
        model = served_model(hp)
        for i, ids in enumerate(others[1:]):  # under 200 tokens: prefilled on gen-f
            expect(hp, model, f"(f) local #{i}", ids[:190])
        mf = settled(mp)
        check(mf.get("duet_worker_prefix_cache_pages", 0) > pages // 2,
              f"(f): the local prompts left only {mf.get('duet_worker_prefix_cache_pages')} "
              "pages in the cache")
        for i, ids in enumerate(others[1:]):  # 200 tokens and more: prefilled by ctx-f
            expect(hp, model, f"(f) transferred #{i}", ids + list(b" Then, at last, it ended."))
        m = settled(mp)
        print({k: v for k, v in m.items() if "prefix" in k or "kv_pages" in k}, flush=True)
        check(m.get("duet_worker_prefix_cache_lookups_total", 0) == 3,
              "(f): a transferred prompt was looked up")
        check(m.get("duet_worker_prefix_cache_evictions_total", 0) >= 1,
              "(f): the reservations evicted nothing")
        free = m.get("duet_worker_kv_pages_free", -1)
        held = m.get("duet_worker_prefix_cache_pages", -1)
        check(free + held == pages,
              f"(f) idle: {free} pages free + {held} held by the cache != the pool's {pages}")
    finish("prefix_cache_gen_cluster", failures, tmp)


main()
