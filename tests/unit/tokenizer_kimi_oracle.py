"""Kimi's tokenizer in duet against the reference: tiktoken with tokenization_kimi.py's rules.

The harness builds a model folder in Kimi-Linear's exact file layout in a temp dir:
  tiktoken.model            the first 163584 ranks of o200k_base (data/tokenizers/, same
                            `base64 rank` format), so that Kimi's specials land on Kimi's ids
                            163584..163841
  tokenizer_config.json     added_tokens_decoder with Kimi's named specials at Kimi's ids (tool-call
                            markers "special": false), bos/eos tokens, an unbounded
                            model_max_length (1e30, as transformers writes it), chat_template
  special_tokens_map.json   bos/eos/unk/pad as AddedToken objects
  config.json, generation_config.json   eos_token_id (an int, a list)
and encodes, with both sides:
  * every line of tests/data/tokenizer/kimi_corpus.jsonl and the whole corpus as one text;
  * special-token cases (recognised only when allowed, reserved names, partial texts);
  * seeded random strings across scripts, whitespace (regex \\s and Python isspace differ),
    apostrophes and case, Unicode 15/16 letters, special-token texts;
  * long texts for Kimi's run splitting: whitespace and non-whitespace runs around 25000
    characters (a special token cut by it), and a text over 400000 characters;
  * every code point (U+0000..U+10FFFF but surrogates) between fixed neighbours, in one context
    (all eight with --all-code-points).
The reference side is tiktoken.Encoding with Kimi's original pat_str (with `&&`), the same ranks
and the special table tokenization_kimi.py builds (added_tokens_decoder names, else
<|reserved_token_ID|>), driven by Kimi's encode: pieces of at most 400000 characters, cut where a
run of str.isspace / non-isspace characters passes 25000, each encoded with allowed_special="all"
(allow_special_tokens=True) or disallowed_special=() (False). duet's side is
tokenizer_oracle_driver, which loads the folder with duet_tokenizer_load as the router does.

Every comparison must give identical ids, and decode(encode(x)) == x on both sides; the special
range's texts, the bos/eos ids and the stop ids (config.json and generation_config.json's
eos_token_id and the eos token, united) must agree too.

Usage: python tokenizer_kimi_oracle.py [--all-code-points] DRIVER SOURCE_DIR
"""

import base64
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import tiktoken
from tiktoken.load import load_tiktoken_bpe

N_BASE = 163584  # Kimi's len(mergeable_ranks)
N_SPECIAL = 258  # TikTokenTokenizer.num_reserved_special_tokens + 2

# tokenization_kimi.py's pat_str, as published (tiktoken syntax, with class intersections)
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Kimi-Linear / K2's named specials (tokenizer_config.json's added_tokens_decoder)
NAMED = {
    163584: ("[BOS]", True),
    163585: ("[EOS]", True),
    163586: ("<|im_end|>", True),
    163587: ("<|im_user|>", True),
    163588: ("<|im_assistant|>", True),
    163590: ("<|start_header_id|>", True),
    163591: ("<|end_header_id|>", True),
    163593: ("[EOT]", True),
    163594: ("<|im_system|>", True),
    163595: ("<|tool_calls_section_begin|>", False),
    163596: ("<|tool_calls_section_end|>", False),
    163597: ("<|tool_call_begin|>", False),
    163598: ("<|tool_call_argument_begin|>", False),
    163599: ("<|tool_call_end|>", False),
    163601: ("<|im_middle|>", True),
    163838: ("[UNK]", True),
    163839: ("[PAD]", True),
}


def fail(msg):
    print(f"tokenizer_kimi_oracle: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def make_folder(d, src):
    with open(os.path.join(src, "data/tokenizers/o200k_base.tiktoken"), "rb") as f:
        lines = [l for l in f.read().split(b"\n") if l]
    keep = [l for l in lines if int(l.split(b" ")[1]) < N_BASE]
    if len(keep) != N_BASE:
        fail(f"o200k_base.tiktoken has {len(keep)} ranks below {N_BASE}")
    with open(os.path.join(d, "tiktoken.model"), "wb") as f:
        f.write(b"\n".join(keep) + b"\n")
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": sp,
        }
        for i, (t, sp) in NAMED.items()
    }
    cfg = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "chat_template": "{% for m in messages %}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{% endfor %}",
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    text = json.dumps(cfg, indent=2, ensure_ascii=False)
    # transformers writes an unbounded length as int(1e30); json.dumps cannot produce it from an int
    text = text[:-2] + ',\n  "model_max_length": 1000000000000000019884624838656\n}'
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(text)
    tok = lambda t: {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    with open(os.path.join(d, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": tok("[BOS]"), "eos_token": tok("[EOS]"), "pad_token": tok("[PAD]"), "unk_token": tok("[UNK]")}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "kimi_linear", "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "vocab_size": 163840}, f)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 163584, "eos_token_id": [163586, 163593], "pad_token_id": 163839}, f)
    return cfg


class Reference:
    """tokenization_kimi.py's TikTokenTokenizer, the parts that decide ids: its special table and
    its encode (run splitting), over tiktoken."""

    def __init__(self, d):
        ranks = load_tiktoken_bpe(os.path.join(d, "tiktoken.model"))
        with open(os.path.join(d, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        named = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
        n = len(ranks)
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + N_SPECIAL)}
        self.enc = tiktoken.Encoding(name="tiktoken.model", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=self.special_tokens)

    @staticmethod
    def split_runs(s, limit):
        run, space, start = 0, s[0].isspace() if s else False, 0
        for i, ch in enumerate(s):
            now = ch.isspace()
            if now != space:
                run, space = 1, now
            else:
                run += 1
                if run > limit:
                    yield s[start:i]
                    start, run = i, 1
        yield s[start:]

    def encode(self, text, allow_special):
        ids = []
        for i in range(0, len(text), 400_000):
            for piece in self.split_runs(text[i : i + 400_000], 25_000):
                if allow_special:
                    ids += self.enc.encode(piece, allowed_special="all")
                else:
                    ids += self.enc.encode(piece, disallowed_special=())
        return ids


class Driver:
    def __init__(self, exe, d):
        self.exe, self.d = exe, d

    def run(self, requests):
        p = subprocess.run([self.exe, self.d], input=b"".join(requests), capture_output=True)
        out = p.stdout.decode("ascii", "replace").splitlines()
        if p.returncode != 0 or any(l.startswith("ERR") for l in out):
            fail(f"driver exited {p.returncode}: {out[-1:] if out else ''} {p.stderr.decode(errors='replace')[-500:]}")
        return out

    def encode_many(self, cases):
        reqs = []
        for text, allow in cases:
            b = text.encode("utf-8")
            reqs.append(b"E %d %d\n" % (1 if allow else 0, len(b)) + b)
        out = self.run(reqs)
        if len(out) != len(cases):
            fail(f"driver answered {len(out)} of {len(cases)} encodes")
        res = []
        for line in out:
            f = line.split()
            if int(f[0]) != len(f) - 2:
                fail(f"driver line malformed: {line[:80]}")
            res.append((int(f[1]) == 1, [int(x) for x in f[2:]]))
        return res


def random_cases(rng, n):
    pools = [
        (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x530, 0x58F),
        (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x10A0, 0x10FF), (0x1100, 0x11FF),
        (0x1C80, 0x1C8A), (0x1E00, 0x1EFF), (0x2000, 0x206F), (0x2100, 0x214F), (0x2E80, 0x2FDF),
        (0x3000, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xA7C0, 0xA7DC), (0xAC00, 0xD7A3),
        (0xF900, 0xFAFF), (0xFE00, 0xFE6F), (0xFF00, 0xFFEF), (0x105C0, 0x105F3), (0x10D40, 0x10D8F),
        (0x11F00, 0x11F5A), (0x1D400, 0x1D7FF), (0x1E4D0, 0x1E4F9), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF),
        (0x2B730, 0x2B740), (0x2EBF0, 0x2EE5D), (0x30000, 0x3134F), (0x31350, 0x323AF), (0xE0000, 0xE007F),
    ]
    # regex \s and Python isspace disagree on some of these (U+001C..U+001F, U+180E)
    spaces = ["\t", "\n", "\x0b", "\x0c", "\r", " ", "\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\xa0", "\u1680",
              "\u180e", "\u2000", "\u200a", "\u200b", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\r\n", "  "]
    bits = ["'s", "'S", "'t", "'re", "'RE", "'ve", "'Ve", "'m", "'M", "'ll", "'LL", "'d", "'D", "'ſ", "'", "’s",
            "<|im_end|>", "[BOS]", "<|im_middle|>", "<|reserved_token_163700|>", "<|tool_call_begin|>", "<|im_", "|>",
            "123", "4567", "3.14", "I", "A", "a", "Σ", "ǅ"]
    cases = []
    for _ in range(n):
        s = []
        for _ in range(rng.randint(1, 14)):
            r = rng.random()
            if r < 0.55:
                lo, hi = rng.choice(pools)
                for _ in range(rng.randint(1, 5)):
                    c = rng.randint(lo, hi)
                    if not 0xD800 <= c <= 0xDFFF:
                        s.append(chr(c))
            elif r < 0.8:
                s.append(rng.choice(spaces) * rng.randint(1, 3))
            else:
                s.append(rng.choice(bits))
        cases.append("".join(s))
    return cases


def long_cases():
    run = 25_000
    cases = [
        " " * run,
        " " * (run + 1),
        "x" + " " * (run + 1) + "y",
        " " * 30_000 + "word",
        "\t \n" * 20_001,
        "\x1c" * (run + 10),  # isspace (a run of whitespace to Kimi) but not regex \s
        ("ab.," * 7_000)[: run - 4] + "<|im_end|>" + "tail",  # the run cut splits the special
        ("ab.," * 7_000)[: run - 20] + "<|im_end|>" + "tail",  # the special fits before the cut
        "a-b" * 9_000,
        ("数字1" * 9_000),
        ("é" * run) + "e\u0301" * 10,
        "y" + "\xa0" * (run + 3) + "z",
    ]
    words = "Мой дядя самых честных правил когда не в шутку занемог".split()
    big, n = [], 0
    rng = random.Random(7)
    while n < 420_000:
        w = rng.choice(words) + rng.choice([" ", " ", ", ", "\n"])
        big.append(w)
        n += len(w)
    text = "".join(big)
    cases.append(text)  # crosses the 400000-character cut inside a word (almost surely)
    cases.append(text[:399_998] + "слово" + text[400_003:])  # a word across the cut, on purpose
    return cases


# Every code point between fixed neighbours: each context exercises other classes of the pattern
# (letters joining a lower-case run, upper case starting one, digits, Han runs, punctuation runs,
# whitespace). The CI run takes the first; --all-code-points takes all (about 100 s).
CONTEXTS = [
    lambda c: "x" + c + "y",
    lambda c: c + "x",
    lambda c: "1" + c + "2",
    lambda c: " " + c + "'S",
    lambda c: "A" + c + c + "b",
    lambda c: "." + c + "\n",
    lambda c: c + "  " + c,
    lambda c: "中" + c + "文",
]


def code_point_cases(n_contexts):
    points = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    return ["\n\n".join(ctx(c) for c in points[i : i + 50_000])
            for ctx in CONTEXTS[:n_contexts] for i in range(0, len(points), 50_000)]


def main():
    args = [a for a in sys.argv[1:] if a != "--all-code-points"]
    if len(args) != 2:
        fail("usage: tokenizer_kimi_oracle.py [--all-code-points] DRIVER SOURCE_DIR")
    exe, src = args
    n_contexts = len(CONTEXTS) if "--all-code-points" in sys.argv else 1
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="duet-kimi-tok-") as d:
        cfg = make_folder(d, src)
        ref = Reference(d)
        drv = Driver(exe, d)

        corpus_path = os.path.join(src, "tests/data/tokenizer/kimi_corpus.jsonl")
        with open(corpus_path, encoding="utf-8") as f:
            corpus = [json.loads(l) for l in f if l.strip()]
        texts = corpus + ["\n".join(corpus)]
        texts += [
            "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
            "[BOS][EOS][BOS]", "<|im_end|><|im_end|>", "a<|reserved_token_163600|>b", "<|reserved_token_163841|>",
            "<|reserved_token_163842|>", "<|reserved_token_163583|>", "<|im_end", "<|im_end|", "im_end|>",
            "x [UNK] y [PAD]", "<|<|im_end|>|>", "[[BOS]]",
        ]
        texts += random_cases(random.Random(20240229), 4000)
        cases = [(t, allow) for t in texts for allow in (False, True)]
        # long texts hold no special token text but one: encoding them once is enough
        longs = long_cases()
        texts += longs
        cases += [(t, allow) for t in longs for allow in ((False, True) if "<|" in t else (False,))]
        every = code_point_cases(n_contexts)
        texts += every
        cases += [(t, False) for t in every]
        got = drv.encode_many(cases)
        n_tokens, n_bad = 0, 0
        for (text, allow), (rt, ids) in zip(cases, got):
            want = ref.encode(text, allow)
            n_tokens += len(want)
            problems = []
            if ids != want:
                first = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
                problems.append(f"ids differ at {first} (duet {ids[first:first + 8]}, tiktoken {want[first:first + 8]}; {len(ids)} vs {len(want)} ids)")
            if not rt:
                problems.append("duet's decode(encode(x)) != x")
            if ref.enc.decode_bytes(want) != text.encode("utf-8"):
                problems.append("tiktoken's decode(encode(x)) != x")
            if problems:
                n_bad += 1
                if n_bad <= 10:
                    print(f"MISMATCH allow_special={allow} text={text[:120]!r} ({len(text)} chars): {'; '.join(problems)}", file=sys.stderr)
        if n_bad:
            fail(f"{n_bad} of {len(cases)} encodings differ")

        # the special range: every id's text, as tokenization_kimi.py names it
        out = drv.run([b"T %d\n" % i for i in range(N_BASE - 1, N_BASE + N_SPECIAL + 1)])
        for i, line in zip(range(N_BASE - 1, N_BASE + N_SPECIAL + 1), out):
            hexbytes, special, _ = line.split()
            if N_BASE <= i < N_BASE + N_SPECIAL:
                want = ref.enc.decode_single_token_bytes(i).hex()
                if hexbytes != want or special != "1":
                    fail(f"special id {i}: duet {bytes.fromhex(hexbytes)!r} special={special}, Kimi {bytes.fromhex(want)!r}")
            elif i == N_BASE - 1 and (hexbytes != ref.enc.decode_single_token_bytes(i).hex() or special != "0"):
                fail(f"last rank {i} differs")
            elif i >= N_BASE + N_SPECIAL and hexbytes != "-":
                fail(f"id {i} past the special range exists in duet")

        info = drv.run([b"I\n"])[0].split()
        want_bos, want_eos = ref.special_tokens[cfg["bos_token"]], ref.special_tokens[cfg["eos_token"]]
        if info != [str(N_BASE + N_SPECIAL), str(want_bos), str(want_eos)]:
            fail(f"vocab/bos/eos: duet {info}, Kimi {[N_BASE + N_SPECIAL, want_bos, want_eos]}")

        stops = []
        for name in ("config.json", "generation_config.json"):
            with open(os.path.join(d, name)) as f:
                v = json.load(f).get("eos_token_id")
            for x in v if isinstance(v, list) else [v]:
                if x is not None and x not in stops:
                    stops.append(x)
        if want_eos not in stops:
            stops.append(want_eos)
        got_stops = [int(x) for x in drv.run([b"S\n"])[0].split()[1:]]
        if got_stops != stops:
            fail(f"stop ids: duet {got_stops}, config.json + generation_config.json + eos token {stops}")

    print(f"tokenizer_kimi_oracle: {len(cases)} encodings of {len(texts)} strings ({sum(len(t) for t in texts)} characters, "
          f"{len(corpus)} corpus lines, every code point in {n_contexts} context(s), specials allowed and not) "
          f"gave {n_tokens} identical ids; "
          f"{N_SPECIAL} special texts, bos/eos and {len(stops)} stop ids agree ({time.time() - t0:.1f} s)")
    print("tokenizer_kimi_oracle: PASS")


if __name__ == "__main__":
    main()
