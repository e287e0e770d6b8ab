#!/usr/bin/env python3
"""duet-bench --accuracy against a FAKE server (tests/integration/fake_echo_logprobs_server.py).

The server side of echo + logprobs with max_tokens 0 is not in duet-router yet, so duet-bench's
client side is tested against a fake whose log-probabilities follow a known rule; this script
computes every expected number on its own (from the rule, hashlib, and the t statistic's
formula) and compares with what duet-bench wrote:
  - per-document bits per byte, bytes and tokens scored, sha256 (JSONL documents with non-ASCII
    text, so code-point offsets differ from byte offsets), and --accuracy-doc-bytes cutting;
  - the paired test: the same server again (every difference 0: did not drop, exit 0), a server
    worse by 0.02 nats per token (dropped, exit 3, t and df as computed here), a server with
    other noise but the same expectation (did not drop, exit 0);
  - refusals: a baseline over other documents (one changed, one fewer: exit 2), a server without
    logprobs, one that generates after the prompt, an HTTP 500 (exit 1, no partial result);
  - bench/accuracy_docs.py on a small corpus: documents come from the held-out 2 % only, cut at
    whitespace, and together are that text with its whitespace runs between documents removed.
Needs only python3's standard library. Usage: test_bench_accuracy.py DUET_BENCH SOURCE_DIR
"""
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fake_echo_logprobs_server import fake_logprob  # noqa: E402

BENCH, SRC = sys.argv[1], sys.argv[2]
TMP = tempfile.mkdtemp(prefix="duet-bench-acc-")
FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILS.append(what)


class Server:
    def __init__(self, *args):
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "fake_echo_logprobs_server.py"),
                                   *args], stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        assert line.startswith("port "), line
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.p.terminate()
        self.p.wait()


def bench(url, *args):
    r = subprocess.run([BENCH, "--url", url, "--quiet", *args], capture_output=True, text=True,
                       timeout=120)
    return r.returncode, r.stdout + r.stderr


def expected_bpb(text, worse=0.0, seed=0):
    """BOS first: every code point is scored, every byte of the text counts."""
    s = sum(fake_logprob(text, i, worse, seed) for i in range(len(text)))
    return -s / math.log(2) / len(text.encode("utf-8")), len(text)


DOCS = [f"Document {i}: " + " ".join(["caf\u00e9", "na\u00efve", "\u65e5\u672c\u8a9e", "plain",
                                       "words"][(i + k) % 5] for k in range(10 + 3 * i))
        for i in range(12)]


def write_docs(name, docs):
    path = os.path.join(TMP, name)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": len(d)}) + "\n")
    return path


def load(name):
    with open(os.path.join(TMP, name)) as f:
        return json.load(f)


def main():
    docs = write_docs("docs.jsonl", DOCS)
    base = os.path.join(TMP, "base.json")
    with Server("--noise-seed", "1") as s:
        rc, out = bench(s.url, "--accuracy", docs, "--json", base)
        check(rc == 0, f"a first accuracy run exits 0 (rc {rc}: {out[-300:]})")
        j = load("base.json")["accuracy"]
        check(j["documents"] == len(DOCS), "every document scored")
        per = j["per_document"]
        ok = True
        for d, p in zip(DOCS, per):
            want, ntok = expected_bpb(d, 0.0, 1)
            ok &= abs(p["bits_per_byte"] - want) <= 1e-9 * want
            ok &= p["bytes_scored"] == len(d.encode("utf-8")) == p["bytes"]
            ok &= p["tokens_scored"] == ntok
            ok &= p["sha256"] == "sha256:" + hashlib.sha256(d.encode("utf-8")).hexdigest()
        check(ok, "per-document bits per byte, bytes, tokens and sha256 as the rule gives")
        mean = sum(p["bits_per_byte"] for p in per) / len(per)
        check(abs(j["mean_bits_per_byte"] - mean) <= 1e-12, "mean over documents")

        rc, out = bench(s.url, "--accuracy", docs, "--baseline", base, "--json",
                        os.path.join(TMP, "same.json"))
        c = load("same.json")["comparison"]
        check(rc == 0 and not c["dropped"] and c["p"] == 1 and c["mean_diff"] == 0,
              f"the same server: did not drop (rc {rc}, {c})")

        # other document sets are refused before any request
        other = write_docs("other.jsonl", DOCS[:5] + [DOCS[5] + "!"] + DOCS[6:])
        rc, out = bench(s.url, "--accuracy", other, "--baseline", base)
        check(rc == 2 and "different document sets" in out, f"a changed document: exit 2 ({rc})")
        fewer = write_docs("fewer.jsonl", DOCS[:-1])
        rc, out = bench(s.url, "--accuracy", fewer, "--baseline", base)
        check(rc == 2 and "different document sets" in out, f"a document fewer: exit 2 ({rc})")

    with Server("--noise-seed", "1", "--worse", "0.02") as s:
        rc, out = bench(s.url, "--accuracy", docs, "--baseline", base, "--json",
                        os.path.join(TMP, "worse.json"))
        w = load("worse.json")
        c = w["comparison"]
        d = [a["bits_per_byte"] - b["bits_per_byte"]
             for a, b in zip(w["accuracy"]["per_document"], per)]
        n = len(d)
        md = sum(d) / n
        sd = math.sqrt(sum((x - md) ** 2 for x in d) / (n - 1))
        t = md / (sd / math.sqrt(n))
        check(rc == 3 and c["dropped"] and c["p"] < 0.01, f"worse by 0.02 nats/token: exit 3 "
              f"(rc {rc}, p {c['p']})")
        check(abs(c["t"] - t) <= 1e-6 * abs(t) and c["df"] == n - 1,
              f"t {c['t']} vs {t} computed here, df {c['df']}")
        check("DROPPED" in out, "the verdict is printed")

    with Server("--noise-seed", "2") as s:
        rc, out = bench(s.url, "--accuracy", docs, "--baseline", base, "--json",
                        os.path.join(TMP, "noise.json"))
        c = load("noise.json")["comparison"]
        check(rc == 0 and not c["dropped"] and c["mean_diff"] != 0,
              f"other noise, same expectation: did not drop (rc {rc}, p {c['p']})")

    # plain text cut into documents of N bytes at character boundaries
    text = "".join(DOCS)
    plain = os.path.join(TMP, "plain.txt")
    with open(plain, "w", encoding="utf-8") as f:
        f.write(text)
    with Server() as s:
        rc, out = bench(s.url, "--accuracy", plain, "--accuracy-doc-bytes", "100", "--json",
                        os.path.join(TMP, "plain.json"))
        per = load("plain.json")["accuracy"]["per_document"]
        total = len(text.encode("utf-8"))
        check(rc == 0 and sum(p["bytes"] for p in per) == total, "the cut covers the text")
        check(all(98 <= p["bytes"] <= 100 for p in per[:-1]) and len(per) >= total // 100,
              f"documents of 100 bytes, moved back at most to a character boundary "
              f"({[p['bytes'] for p in per]})")

    for mode, why in (("no-logprobs", "echo"), ("generate-extra", "not the end of the document"),
                      ("http500", "HTTP 500")):
        with Server("--mode", mode) as s:
            rc, out = bench(s.url, "--accuracy", docs, "--json", os.path.join(TMP, mode + ".json"))
            check(rc == 1 and why in out and not os.path.exists(os.path.join(TMP, mode + ".json")),
                  f"a server with {mode}: exit 1 naming '{why}', no result file (rc {rc})")

    # the held-out documents of a small corpus
    corpus = os.path.join(TMP, "corpus")
    os.mkdir(corpus)
    raw = {"a.txt": ("alpha beta gamma delta " * 400).encode(),
           "b.txt": ("\u00e9t\u00e9 hiver " * 600).encode("utf-8")}
    for name, b in raw.items():
        with open(os.path.join(corpus, name), "wb") as f:
            f.write(b)
    out = os.path.join(TMP, "held.jsonl")
    r = subprocess.run([sys.executable, os.path.join(SRC, "bench", "accuracy_docs.py"), "--data",
                        corpus, "--doc-bytes", "50", out], capture_output=True, text=True)
    check(r.returncode == 0, f"accuracy_docs.py runs ({r.stderr[-300:]})")
    rows = [json.loads(x) for x in open(out, encoding="utf-8")]
    ok = len(rows) > 4
    for name, b in raw.items():
        cut = int(len(b) * 0.98)
        mine = [x for x in rows if x["source"] == name]
        ok &= len(mine) > 1
        for x in mine:
            tb = x["text"].encode("utf-8")
            ok &= x["offset"] >= cut and b[x["offset"]:x["offset"] + len(tb)] == tb
            ok &= 50 <= len(tb) or x is mine[-1]
            ok &= not x["text"][0].isspace() and not x["text"][-1].isspace()
        p0 = cut
        while p0 < len(b) and b[p0:p0 + 1] not in (b" ", b"\n"):  # the word the cut fell into
            p0 += 1
        held = b[p0:].decode("utf-8").split()
        ok &= " ".join(x["text"] for x in mine).split() == held
    check(ok, "held-out documents: past the 2 % cut, at whitespace, covering the held-out words")

    print(f"{len(FAILS)} failed" if FAILS else "all passed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
