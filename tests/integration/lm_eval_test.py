"""EleutherAI's lm-evaluation-harness (lm-eval, a real client) against a local duet cluster.

Starts duet-router, one duet-ctx and one duet-gen on the demo model (CPU, f32, the same prefill
chunk as duet-generate, so the logits are bit-identical to the single-process reference), then
runs lm_eval.simple_evaluate with its `local-completions` model on the two tiny tasks in
tests/data/lm_eval (a multiple-choice loglikelihood task and a greedy generate_until task, both
loaded from JSONL files in the repository: nothing is downloaded, HF_*_OFFLINE is set).

The harness tokenizes itself (tokenized_requests, tokenizer_backend huggingface): the tokenizer is
a Hugging Face tokenizer written here by bench/demo_hf_tokenizer.py that reproduces the demo
tokenizer (models/duet-demo/duet_tokenizer.json: one id per byte, <|bos|> 256, <|eos|> 257) and,
with add_bos_token, prepends BOS as the router's completion_prefix does for a text prompt. So the
harness sends token-id prompts [256] + UTF-8 bytes (the router adds nothing to those), each
request alone (batch_size 1, num_concurrent 1: a list of one id list), "model" from /v1/models:
  - loglikelihood of a choice: {"prompt": [[256, *context bytes, *(" " + choice) bytes]],
    "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}; lm-eval sums
    token_logprobs[1 + len(context bytes) : -1] (the last is the generated token's) and calls it
    greedy if each of those is the top of its top_logprobs;
  - generate_until: {"prompt": [[256, *context bytes]], "max_tokens": 24, "temperature": 0,
    "stop": ["\\n", ".", "<|eos|>"], "seed": 1234} (lm-eval adds the EOS text to `until`); it
    cuts the returned text at the first `until` string again.
Every request is recorded (requests.post is wrapped) and its prompt checked to be exactly that.

Checks, against duet-generate (the single-process reference), 1e-4 absolute on log-likelihoods:
  - the tokenizer equals the router's own /tokenize for each string sent;
  - each (context, choice) log-likelihood equals the sum of log-softmax over duet-generate
    --dump-logits rows at the continuation's ids, and is_greedy its argmax test;
  - acc and acc_norm (lm-eval's: by the choice's length in characters) equal the ones derived from those
    sums; so does the per-document acc;
  - each generation equals duet-generate's greedy text (24 tokens) cut at the first "\\n" or
    "." (at least one is cut there); exact_match equals the one derived from those texts.

Usage: lm_eval_test.py BUILD_DIR MODEL_DIR. Exits 77 (ctest: skipped) only if the venv lacks
lm_eval or transformers, with a message naming tests/python/setup.sh. Env: LM_EVAL_TEST_LOG_LEVEL,
the processes' log level (default warn); logs stay in the temp dir a failure names.
"""
import json
import os
import struct
import sys
import tempfile
import urllib.request

from duet_cluster import (check, cluster, failures, finish, generate as duet_generate,
                          log_softmax_at, served_model)

BUILD, MODEL = sys.argv[1], sys.argv[2]
SRC = os.path.dirname(os.path.dirname(os.path.abspath(MODEL)))
TASKS = f"{SRC}/tests/data/lm_eval"
BOS = json.load(open(f"{MODEL}/config.json"))["bos_token_id"]  # the reference's own, 256
TOL = 1e-4
sys.path.insert(0, f"{SRC}/bench")
MAX_GEN, UNTIL = 24, ("\n", ".")  # tests/data/lm_eval/duet_gen.yaml's generation_kwargs

try:
    import lm_eval  # noqa: F401
    import transformers  # noqa: F401
    import tokenizers  # noqa: F401
    from demo_hf_tokenizer import make_tokenizer
except ImportError as e:
    print(f"SKIP: lm_eval_test needs lm-eval and transformers in the tests' venv ({e}); "
          "make it with: bash tests/python/setup.sh BUILD_DIR")
    sys.exit(77)




def generate(ids, max_tokens, dump=None):
    return duet_generate(BUILD, MODEL, ids, max_tokens, dump=dump)


def reference_loglikelihood(ctx, cont, tmp):
    """(sum of log p(continuation bytes | BOS + context), is_greedy) from duet-generate's
    logits."""
    ids = [BOS] + list((ctx + cont).encode())
    n_ctx = 1 + len(ctx.encode())
    dump = f"{tmp}/ll.logits"
    generate(ids, 1, dump=dump)
    raw = open(dump, "rb").read()
    V = len(raw) // 4 // len(ids)
    total, greedy = 0.0, True
    for r in range(n_ctx - 1, len(ids) - 1):
        row = struct.unpack_from(f"<{V}f", raw, r * V * 4)
        total += log_softmax_at(row, ids[r + 1])
        greedy = greedy and max(range(V), key=row.__getitem__) == ids[r + 1]
    return total, greedy


def reference_generation(ctx):
    """duet-generate's greedy text cut at the first `until` string, and whether it was cut."""
    whole = generate([BOS] + list(ctx.encode()), MAX_GEN)["text"]
    text = whole
    for u in UNTIL:
        text = text.split(u)[0]
    return text, text != whole


def main():
    tmp = tempfile.mkdtemp(prefix="duet-lm-eval-")
    # 32 slots: lm-eval's back-to-back requests can outrun the release of finished requests'
    # slots (429 "all request slots are in use" with 4, docs/benchmark.md); no 429 is retried
    with cluster(BUILD, MODEL, tmp, [("ctx-0", "ctx", []), ("gen-0", "gen", [])],
                 router_args=["--placement.local_prefill_tokens", "16"], max_seqs=32,
                 log_level=os.environ.get("LM_EVAL_TEST_LOG_LEVEL", "warn")) as port:
        run_checks(port, served_model(port), tmp)
    finish("lm_eval", failures, tmp)


def run_checks(port, model, tmp):
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "HF_HOME": f"{tmp}/hf",
                       "TOKENIZERS_PARALLELISM": "false"})
    tok_dir = f"{tmp}/tokenizer"
    hf = make_tokenizer(tok_dir)
    for text in ("In the beginning", "Hamor’s son.", "\n\u00e9\U0001f600 x"):  # 1 to 4 bytes each
        check(hf.encode(text) == [BOS] + list(text.encode()) and
              hf.encode(text, add_special_tokens=False) == list(text.encode()) and
              hf.decode(list(text.encode())) == text, f"the HF tokenizer on {text!r}")

    import requests
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    sent = []  # every request body the harness posts
    real_post = requests.post

    def recording_post(url, json=None, **kw):
        sent.append(json)
        return real_post(url, json=json, **kw)

    requests.post = recording_post
    os.chdir(TASKS)  # the tasks' data_files are relative to their directory
    try:
        out = simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": model,
                         "tokenizer_backend": "huggingface", "tokenizer": tok_dir,
                         "tokenized_requests": True, "add_bos_token": True,
                         "num_concurrent": 1, "max_retries": 1, "max_length": 1024},
            tasks=["duet_mc", "duet_gen"], task_manager=TaskManager(include_path=TASKS),
            log_samples=True, batch_size=1)
    finally:
        requests.post = real_post
    res, samples = out["results"], out["samples"]
    print("lm-eval results:", json.dumps({t: {k: v for k, v in r.items() if k != "alias"}
                                          for t, r in res.items()}), flush=True)

    # what was sent: token-id prompts, BOS first, then the UTF-8 bytes; the tokenizer matches
    # the router's own /tokenize for a text prompt
    docs_mc = [json.loads(line) for line in open(f"{TASKS}/duet_mc.jsonl", encoding="utf-8")]
    docs_gen = [json.loads(line) for line in open(f"{TASKS}/duet_gen.jsonl", encoding="utf-8")]
    want_ll = {tuple([BOS] + list(f"{d['context']} {c}".encode()))
               for d in docs_mc for c in d["choices"]}
    want_gen = {tuple([BOS] + list(d["context"].encode())) for d in docs_gen}
    got_ll, got_gen = set(), set()
    for body in sent:
        p = body["prompt"]
        p = p[0] if len(p) == 1 and isinstance(p[0], list) else p  # a batch of one
        check(isinstance(p, list) and all(isinstance(i, int) for i in p),
              f"prompt not token ids: {body}")
        if body.get("echo"):
            check(body["max_tokens"] == 1 and body["logprobs"] == 1, f"scoring body {body}")
            got_ll.add(tuple(p))
        else:
            check(body["max_tokens"] == MAX_GEN and list(body["stop"]) == [*UNTIL, "<|eos|>"] and
                  body["temperature"] == 0, f"generation body {body}")
            got_gen.add(tuple(p))
    check(got_ll == want_ll, f"scored prompts: {len(got_ll)} sent, {len(want_ll)} expected "
          f"(missing {[bytes(x[1:]) for x in want_ll - got_ll]})")
    check(got_gen == want_gen, f"generation prompts: {len(got_gen)} sent, {len(want_gen)} wanted")
    for text in [d["context"] for d in docs_gen] + [docs_mc[1]["choices"][1]]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize",
                                     data=json.dumps({"prompt": text}).encode(),
                                     headers={"Content-Type": "application/json"})
        router_ids = json.loads(urllib.request.urlopen(req, timeout=10).read())["tokens"]
        check(router_ids == [BOS] + list(text.encode()), f"/tokenize {text!r}: {router_ids}")

    # loglikelihood: every (context, choice) against duet-generate's logits; acc, acc_norm
    by_doc = {s["doc_id"]: s for s in samples["duet_mc"]}
    check(sorted(by_doc) == list(range(len(docs_mc))), f"duet_mc samples {sorted(by_doc)}")
    acc = acc_norm = 0
    for i, d in enumerate(docs_mc):
        refs = [reference_loglikelihood(d["context"], " " + c, tmp) for c in d["choices"]]
        got = [tuple(r[0]) for r in by_doc[i]["resps"]]
        for j, ((lg, gg), (lr, gr)) in enumerate(zip(got, refs)):
            check(abs(lg - lr) <= TOL, f"mc doc {i} choice {j}: lm-eval {lg}, duet-generate {lr}")
            check(bool(gg) == gr, f"mc doc {i} choice {j}: is_greedy {gg}, duet-generate {gr}")
        lls = [r[0] for r in refs]
        pick = max(range(len(lls)), key=lls.__getitem__)
        norm = [ll / len(c) for ll, c in zip(lls, d["choices"])]  # lm-eval: characters, no delimiter
        pick_norm = max(range(len(norm)), key=norm.__getitem__)
        acc += pick == d["label"]
        acc_norm += pick_norm == d["label"]
        check(by_doc[i]["acc"] == float(pick == d["label"]), f"mc doc {i}: acc {by_doc[i]['acc']}")
        print(f"mc doc {i}: log-likelihoods {[round(x, 4) for x in lls]} (lm-eval "
              f"{[round(x[0], 4) for x in got]}), pick {pick}, label {d['label']}", flush=True)
    check(abs(res["duet_mc"]["acc,none"] - acc / len(docs_mc)) < 1e-9,
          f"acc {res['duet_mc']['acc,none']}, from duet-generate {acc / len(docs_mc)}")
    check(abs(res["duet_mc"]["acc_norm,none"] - acc_norm / len(docs_mc)) < 1e-9,
          f"acc_norm {res['duet_mc']['acc_norm,none']}, from duet-generate "
          f"{acc_norm / len(docs_mc)}")

    # generation: duet-generate's greedy text cut at `until`; exact_match from those texts
    by_doc = {s["doc_id"]: s for s in samples["duet_gen"]}
    check(sorted(by_doc) == list(range(len(docs_gen))), f"duet_gen samples {sorted(by_doc)}")
    em = cuts = 0
    for i, d in enumerate(docs_gen):
        want, cut = reference_generation(d["context"])
        cuts += cut
        got = by_doc[i]["filtered_resps"][0]
        check(got == want, f"gen doc {i}: lm-eval {got!r}, duet-generate {want!r}")
        check(want != "", f"gen doc {i}: empty generation (the case proves little)")
        em += want == d["target"]  # lm-eval's exact_match: equality, no normalisation
        print(f"gen doc {i}: {d['context']!r} -> {got!r}", flush=True)
    check(cuts > 0, "no generation met a stop string (the `until` path is not exercised)")
    check(abs(res["duet_gen"]["exact_match,none"] - em / len(docs_gen)) < 1e-9,
          f"exact_match {res['duet_gen']['exact_match,none']}, from duet-generate "
          f"{em / len(docs_gen)}")


main()
