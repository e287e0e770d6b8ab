"""Log-probabilities and logit processing through a real local cluster, against duet-generate.

Starts duet-router, one duet-ctx and two duet-gen on the demo model (CPU, f32, the same prefill
chunk as duet-generate, so batch invariance makes the logits bit-identical; gen-1 speculates with
the shipped draft model: requests with logprobs speculate there, their logprobs from the verify
rows, requests with logit processing do not; round-robin placement, every check runs on both),
then checks:
  - greedy completions with logprobs + top_logprobs, by local prefill (a short prompt) and by
    remote prefill on the context worker (a long one), equal duet-generate --logprobs: the same
    tokens, every logprob within 1e-4 absolute (float32 logits, log-softmax in double on both
    sides; the JSON carries 9 significant digits), the same top ids in the same order;
  - echo with max_tokens 0 (prompt scoring, by the gen worker) equals the log-softmax of
    duet-generate --dump-logits' rows at the prompt's ids (1e-4), and echo while generating (the
    context worker scores the prompt) gives the same, then duet-generate's tokens;
  - presence / frequency / repetition penalties, logit_bias and min_tokens give duet-generate's
    greedy tokens with the same flags, on both paths;
  - chat logprobs parse with the official openai client (ChatCompletion.choices[0].logprobs):
    top_logprobs as asked, the bytes spell the content, streamed chunks carry the same values;
  - stop_token_ids end the text before the first such id of duet-generate's output, "stop";
  - bad values are 400s naming the parameter;
  - duet-bench --accuracy (bench/accuracy_docs.py's held-out documents, 4 of ~120 bytes): each
    document's bits per byte equals the one from duet-generate --dump-logits (1e-4), a run
    against itself as baseline is not a drop, against a baseline 0.05 bits/byte better it is.

Usage: logprobs_cluster_test.py BUILD_DIR MODEL_DIR (the draft model is MODEL_DIR's sibling
duet-demo-draft). Env: LOGPROBS_TEST_LOG_LEVEL, the processes' log level (default warn); their
logs stay in the temp dir the failure message names.
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from duet_cluster import (check, cluster, failures, finish, generate as duet_generate,
                          log_softmax_at, served_model)

BUILD, MODEL = sys.argv[1], sys.argv[2]
DRAFT = os.path.join(os.path.dirname(MODEL), "duet-demo-draft")
LOCAL_BELOW = 16  # prompts shorter than this are prefilled by the gen worker
TOL = 1e-4

def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def generate(ids, max_tokens, extra=(), dump=None):
    """duet-generate's greedy run over token ids: its --json object (with logprobs)."""
    return duet_generate(BUILD, MODEL, ids, max_tokens, extra, dump)


def main():
    tmp = tempfile.mkdtemp(prefix="duet-logprobs-")
    workers = [("ctx-0", "ctx", []), ("gen-0", "gen", []),
               ("gen-1", "gen", ["--spec.method", "draft", "--spec.k", "3",
                                 "--spec.draft-model", DRAFT])]
    with cluster(BUILD, MODEL, tmp, workers,
                 router_args=["--placement.local_prefill_tokens", str(LOCAL_BELOW),
                              "--placement.policy", "round_robin"],
                 log_level=os.environ.get("LOGPROBS_TEST_LOG_LEVEL", "warn")) as port:
        run_checks(port, served_model(port), tmp)
    finish("logprobs_cluster", failures, tmp)


def compare_completion(port, model, ids, n_top, what):
    body = {"model": model, "prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": n_top}
    st, text = post(port, "/v1/completions", body)
    check(st == 200, f"{what}: HTTP {st}: {text}")
    if st != 200:
        return
    choice = json.loads(text)["choices"][0]
    lp = choice["logprobs"]
    ref = generate(ids, 12, ["--logprobs", str(n_top)])
    n = len(ref["logprobs"])
    # the stream stops at EOS; duet-generate lists the EOS id too
    check(len(lp["token_logprobs"]) == n, f"{what}: {len(lp['token_logprobs'])} logprobs, "
          f"duet-generate {n}")
    for i, (got, want) in enumerate(zip(lp["token_logprobs"], ref["logprobs"])):
        check(abs(got - want["logprob"]) <= TOL, f"{what}: token {i}: {got} vs {want['logprob']}")
        tops = list(lp["top_logprobs"][i].values())
        want_top = [t[1] for t in want["top"]]
        check(all(abs(a - b) <= TOL for a, b in zip(tops, want_top)) and len(tops) >= n_top,
              f"{what}: top {i}: {tops} vs {want_top}")
    check(len(lp["tokens"]) == n and len(lp["text_offset"]) == n, f"{what}: list lengths")


def metric(port, name):
    """The sum of a counter's series on the router's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def check_accuracy_gate(port, tmp):
    """duet-bench --accuracy through the cluster: each document's bits per byte equals the one
    computed from duet-generate --dump-logits (1e-4), the same run against itself as a baseline
    is not a drop (exit 0), and against a baseline 0.05 bits per byte better on every document it
    is (exit 3)."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(MODEL)))
    docs = f"{tmp}/heldout.jsonl"
    subprocess.run([sys.executable, f"{src}/bench/accuracy_docs.py", "--data", f"{src}/data/corpus",
                    "--doc-bytes", "120", docs],
                   check=True, capture_output=True)
    texts = [json.loads(line)["text"] for line in open(docs, encoding="utf-8")][:4]
    with open(docs, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    bench = [f"{BUILD}/bench/duet-bench", "--url", f"http://127.0.0.1:{port}", "--quiet",
             "--accuracy", docs]
    acc = f"{tmp}/acc.json"
    run = subprocess.run(bench + ["--json", acc], capture_output=True, text=True)
    check(run.returncode == 0, f"duet-bench --accuracy: exit {run.returncode}: {run.stderr[-400:]}")
    if run.returncode != 0:
        return
    got = json.load(open(acc))
    per_doc = got["accuracy"]["per_document"] if "accuracy" in got else got["per_document"]
    check(len(per_doc) == len(texts), f"accuracy: {len(per_doc)} documents scored")
    for i, t in enumerate(texts):  # the demo tokenizer: BOS, then one id per byte
        ids = [256] + list(t.encode())
        dump = f"{tmp}/acc{i}.logits"
        generate(ids, 1, dump=dump)
        raw = open(dump, "rb").read()
        V = len(raw) // 4 // len(ids)
        nats = sum(log_softmax_at(struct.unpack_from(f"<{V}f", raw, r * V * 4), ids[r + 1])
                   for r in range(len(ids) - 1))
        want = -nats / math.log(2) / len(t.encode())
        check(abs(per_doc[i]["bits_per_byte"] - want) <= 1e-4,
              f"accuracy: document {i}: {per_doc[i]['bits_per_byte']} bits/byte, "
              f"duet-generate's logits give {want}")
    same = subprocess.run(bench + ["--baseline", acc], capture_output=True, text=True)
    check(same.returncode == 0, f"accuracy against itself: exit {same.returncode}: {same.stdout}")
    better = json.load(open(acc))
    for d in (better["accuracy"]["per_document"] if "accuracy" in better
              else better["per_document"]):
        d["bits_per_byte"] -= 0.05
    json.dump(better, open(f"{tmp}/acc-better.json", "w"))
    drop = subprocess.run(bench + ["--baseline", f"{tmp}/acc-better.json"], capture_output=True,
                          text=True)
    check(drop.returncode == 3 and "DROPPED" in drop.stdout,
          f"accuracy against a better baseline: exit {drop.returncode}: {drop.stdout[-400:]}")


def check_best_of(port, model, prompt):
    """best_of > n returns the n of best_of seeded samples with the highest mean logprob per
    token, best first. The oracle: the same request with n = best_of (choice i samples with
    seed + i either way) and its logprobs, ranked here. A zero logit_bias (no effect on the
    distribution) keeps gen-1 from speculating: speculative sampling spends its random draws
    otherwise, so seeded samples agree across the gen workers only without it."""
    body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 1.0, "seed": 7,
            "logit_bias": {"256": 0}}
    st, text = post(port, "/v1/completions", dict(body, n=5, logprobs=0))
    check(st == 200, f"best_of oracle (n=5): HTTP {st}: {text}")
    st2, text2 = post(port, "/v1/completions", dict(body, n=2, best_of=5, logprobs=0))
    check(st2 == 200, f"best_of=5, n=2: HTTP {st2}: {text2}")
    st3, text3 = post(port, "/v1/completions", dict(body, n=2, best_of=5))
    check(st3 == 200, f"best_of=5, n=2 without logprobs: HTTP {st3}: {text3}")
    if st != 200 or st2 != 200 or st3 != 200:
        return
    every = json.loads(text)["choices"]
    mean = [sum(c["logprobs"]["token_logprobs"]) / max(1, len(c["logprobs"]["token_logprobs"]))
            for c in every]
    order = sorted(range(5), key=lambda i: (-mean[i], i))[:2]
    got = json.loads(text2)
    check([c["index"] for c in got["choices"]] == [0, 1], f"best_of: indexes {got['choices']}")
    check([c["text"] for c in got["choices"]] == [every[i]["text"] for i in order],
          f"best_of: got {[c['text'] for c in got['choices']]}, want choices {order} of "
          f"{[c['text'] for c in every]} (mean logprobs {mean})")
    plain = json.loads(text3)
    check([c["text"] for c in plain["choices"]] == [every[i]["text"] for i in order],
          "best_of without logprobs: another pick")
    check(all(c["logprobs"] is None for c in plain["choices"]),
          "best_of without logprobs: logprobs returned anyway")
    want_tokens = sum(len(c["logprobs"]["token_logprobs"]) for c in every)
    check(plain["usage"]["completion_tokens"] == want_tokens,
          f"best_of usage: {plain['usage']} (all 5 samples: {want_tokens} tokens)")
    print(f"best_of=5, n=2: picked {order} of mean logprobs {[round(m, 3) for m in mean]}",
          flush=True)


def run_checks(port, model, tmp):
    check_accuracy_gate(port, tmp)
    short = [256, 65, 110, 100, 32, 71, 111, 100]  # below LOCAL_BELOW: the gen worker prefills
    long = [256] + list(b"In the beginning God created the heaven and the earth. And the earth")
    for gen in range(2):  # round robin: each path on both generation workers
        compare_completion(port, model, short, 3, f"local prefill #{gen}")
        compare_completion(port, model, long, 5, f"remote prefill #{gen}")
    # n = 2: each choice carries its own logprobs (greedy: both are duet-generate's)
    st, text = post(port, "/v1/completions", {"model": model, "prompt": long, "max_tokens": 12,
                                               "temperature": 0, "logprobs": 2, "n": 2})
    check(st == 200, f"n=2: HTTP {st}: {text}")
    if st == 200:
        ref = generate(long, 12, ["--logprobs", "2"])
        choices = json.loads(text)["choices"]
        check([c["index"] for c in choices] == [0, 1], f"n=2: {len(choices)} choices")
        for c in choices:
            got = c["logprobs"]["token_logprobs"]
            check(len(got) == len(ref["logprobs"]) and
                  all(abs(a - b["logprob"]) <= TOL for a, b in zip(got, ref["logprobs"])),
                  f"n=2: choice {c['index']}: logprobs differ from duet-generate's")
    check_best_of(port, model, long)
    time.sleep(0.5)  # a heartbeat brings gen-1's counters
    print("spec drafts kept:", metric(port, "duet_gen_spec_accepted_total"), flush=True)
    check(metric(port, "duet_gen_spec_accepted_total") > 0,
          "gen-1 kept no draft for the logprobs requests (the case proves nothing)")

    # penalties, bias, min_tokens: duet-generate's greedy tokens with the same flags
    cases = [
        ({"presence_penalty": 1.5}, ["--presence-penalty", "1.5"]),
        ({"frequency_penalty": 1.2}, ["--frequency-penalty", "1.2"]),
        ({"repetition_penalty": 1.8}, ["--repetition-penalty", "1.8"]),
        ({"logit_bias": {"32": -100, "101": 5}}, ["--logit-bias", "32:-100,101:5"]),
        ({"min_tokens": 20, "presence_penalty": -2.0, "repetition_penalty": 0.5},
         ["--min-tokens", "20", "--presence-penalty", "-2", "--repetition-penalty", "0.5"]),
    ]
    for ids, path in ((short, "local"), (long, "remote"), (short, "local#2"),
                      (long, "remote#2")):
        for body_extra, flags in cases:
            body = {"model": model, "prompt": ids, "max_tokens": 24, "temperature": 0,
                    **body_extra}
            st, text = post(port, "/v1/completions", body)
            check(st == 200, f"{path} {body_extra}: HTTP {st}: {text}")
            if st != 200:
                continue
            got = json.loads(text)["choices"][0]["text"]
            ref = generate(ids, 24, flags)
            check(got == ref["text"], f"{path} {body_extra}: {got!r} vs duet-generate "
                  f"{ref['text']!r}")
            plain = generate(ids, 24)
            check(ref["tokens"] != plain["tokens"], f"{body_extra} changes nothing on {path} "
                  "(the case cannot fail)")

    # stop_token_ids (vLLM): duet-generate's plain greedy text cut before the first such id, "stop";
    # with ignore_eos too (they still stop)
    for ids, path in ((short, "local"), (long, "remote")):
        plain = generate(ids, 24)
        stop_id = plain["tokens"][5]
        cut = plain["tokens"][:plain["tokens"].index(stop_id)]
        for extra in ({}, {"ignore_eos": True}):
            st, text = post(port, "/v1/completions", {"model": model, "prompt": ids,
                                                      "max_tokens": 24, "temperature": 0,
                                                      "stop_token_ids": [stop_id], **extra})
            check(st == 200, f"{path} stop_token_ids {extra}: HTTP {st}: {text}")
            if st == 200:
                c = json.loads(text)["choices"][0]
                check(c["text"] == bytes(cut).decode("utf-8", "replace") and
                      c["finish_reason"] == "stop", f"{path} stop_token_ids {extra}: {c}")

    # streaming with a stop string: the chunks' logprobs, joined, are the non-streamed ones (text
    # held back by a possible stop string keeps its ids' logprobs until it is sent; the finish
    # chunk carries the rest, up to the id that completed the stop string)
    plain_text = generate(long, 24)["text"]
    stop = plain_text[6:8]
    body = {"model": model, "prompt": long, "max_tokens": 24, "temperature": 0, "logprobs": 2,
            "stop": [stop]}
    st, text = post(port, "/v1/completions", body)
    whole = json.loads(text)["choices"][0] if st == 200 else None
    st2, sse = post(port, "/v1/completions", {**body, "stream": True})
    check(st == 200 and st2 == 200, f"stop-string stream: HTTP {st} {st2}")
    if whole is not None and st2 == 200:
        joined, joined_text, finish = [], "", None
        for line in sse.splitlines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                joined_text += c["text"]
                finish = c["finish_reason"] or finish
                if c["logprobs"] is not None:
                    joined += c["logprobs"]["token_logprobs"]
        check(whole["finish_reason"] == "stop" and finish == "stop", "stop string did not stop")
        check(joined_text == whole["text"] == plain_text[:plain_text.index(stop)],
              f"stop-string text {joined_text!r} / {whole['text']!r}")
        check(joined == whole["logprobs"]["token_logprobs"],
              f"streamed logprobs {joined} != {whole['logprobs']['token_logprobs']}")
        n_text = len(whole["text"].encode())
        check(len(joined) > n_text, "the ids of the stop string have logprobs too")

    # echo + max_tokens 0: the prompt's logprobs, scored by the gen worker
    dump = f"{tmp}/prompt.logits"
    generate(long, 1, dump=dump)
    raw = open(dump, "rb").read()
    V = len(raw) // 4 // len(long)
    rows = [struct.unpack_from(f"<{V}f", raw, r * V * 4) for r in range(len(long))]
    st, text = post(port, "/v1/completions", {"model": model, "prompt": long, "max_tokens": 0,
                                              "echo": True, "logprobs": 1})
    check(st == 200, f"echo max_tokens 0: HTTP {st}: {text}")
    if st == 200:
        choice = json.loads(text)["choices"][0]
        tl = choice["logprobs"]["token_logprobs"]
        check(len(tl) == len(long) and tl[0] is None, f"echo: {len(tl)} positions, first {tl[0]}")
        for i in range(1, min(len(tl), len(long))):
            want = log_softmax_at(rows[i - 1], long[i])
            check(tl[i] is not None and abs(tl[i] - want) <= TOL, f"echo: prompt {i}: {tl[i]} vs "
                  f"{want}")
        # the BOS id is a special token the tokenizer skips: no text, as in output
        check(choice["text"] == bytes(long[1:]).decode(), f"echo text {choice['text']!r}")
        offs = choice["logprobs"]["text_offset"]
        check(offs[:3] == [0, 0, 1], f"echo text_offset {offs[:3]}")
        check(choice["finish_reason"] == "length", "echo finish")
        # the same scoring streamed: the prompt as one chunk with its logprobs, then the finish
        st2, sse = post(port, "/v1/completions", {"model": model, "prompt": long,
                                                  "max_tokens": 0, "echo": True, "logprobs": 1,
                                                  "stream": True,
                                                  "stream_options": {"include_usage": True}})
        check(st2 == 200, f"streamed echo max_tokens 0: HTTP {st2}: {sse}")
        events = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
        texts = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        lps = [x for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for x in e["choices"][0]["logprobs"]["token_logprobs"]]
        fins = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        usage = [e["usage"] for e in events if e.get("usage")]
        check(texts == choice["text"], f"streamed echo text {texts!r} vs {choice['text']!r}")
        check(lps == tl, "streamed echo logprobs differ from the non-streamed ones")
        check(fins[-1:] == ["length"], f"streamed echo finish reasons {fins}")
        check(usage[-1:] and usage[-1]["prompt_tokens"] == len(long) and
              usage[-1]["completion_tokens"] == 0, f"streamed echo usage {usage}")
        check(sse.rstrip().endswith("data: [DONE]"), "streamed echo: no [DONE]")
        # echo while generating: the context worker scores the long prompt (remote prefill)
        st, text = post(port, "/v1/completions", {"model": model, "prompt": long,
                                                  "max_tokens": 4, "echo": True, "logprobs": 1,
                                                  "temperature": 0})
        check(st == 200, f"echo max_tokens 4: HTTP {st}: {text}")
        if st == 200:
            c4 = json.loads(text)["choices"][0]
            tl4 = c4["logprobs"]["token_logprobs"]
            ref = generate(long, 4, ["--logprobs", "1"])
            check(len(tl4) == len(long) + 4 and tl4[0] is None, f"echo+4: {len(tl4)} positions")
            check(all(abs(a - b) <= TOL for a, b in zip(tl4[1:len(long)], tl[1:])),
                  "echo+4: the context worker's prompt logprobs differ from the gen worker's")
            check(all(abs(a - b["logprob"]) <= TOL for a, b in zip(tl4[len(long):],
                                                                   ref["logprobs"])),
                  "echo+4: generated logprobs differ from duet-generate")
            check(c4["text"] == choice["text"] + ref["text"], f"echo+4 text {c4['text']!r}")

    # chat through the official client, plain and streamed
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    msgs = [{"role": "user", "content": "Who said let there be light?"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    check(len(content) >= 1 and all(len(c.top_logprobs) == 2 for c in content),
          f"chat logprobs: {content}")
    # byte-level tokens: a character's pieces are U+FFFD each, their bytes spell it
    check(b"".join(bytes(c.bytes) for c in content) == r.choices[0].message.content.encode(),
          "chat logprobs' bytes spell the content")
    check(all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content),
          "chat token strings are their bytes (ill-formed UTF-8 as U+FFFD)")
    s = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2, stream=True)
    streamed = []
    for chunk in s:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    check([c.logprob for c in streamed] == [c.logprob for c in content],
          "streamed chat logprobs equal the non-streamed ones")

    # bad values: 400 naming the parameter
    for body, param in (({"logprobs": 6}, "logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
                        ({"logit_bias": {"x": 1}}, "logit_bias.x"),
                        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
                        ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"min_tokens": 99}, "min_tokens"), ({"max_tokens": 0}, "max_tokens")):
        st, text = post(port, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 4,
                                                  **body})
        err = json.loads(text).get("error", {}) if text.startswith("{") else {}
        check(st == 400 and err.get("param") == param, f"{body}: {st} {text}")
    st, text = post(port, "/v1/chat/completions", {"model": model, "messages": msgs,
                                                   "top_logprobs": 2})
    check(st == 400 and json.loads(text)["error"]["param"] == "top_logprobs", f"{st} {text}")


main()
