#!/usr/bin/env python3
"""Cut the demo model's held-out text into documents for `duet-bench --accuracy`.

Usage: bench/accuracy_docs.py [--data data/corpus] [--doc-bytes 2000] [--held-frac 0.02] OUT

tools/train_demo.py trains on each data/corpus/*.txt file but its last 2 %: the bytes from
int(len * (1 - held_frac)) on. This script takes exactly those bytes of every *.txt file (sorted
by name, as train_demo.py does) and cuts them into documents at whitespace: the first document
starts after the first whitespace at or past the cut (no partial word or character), each
document ends at the first whitespace at or after --doc-bytes bytes from its start (or at the
end of the file, trailing whitespace dropped), and the whitespace between two documents belongs
to neither. OUT gets one JSON object a line: {"text": ..., "source": file name, "offset": byte
offset of the text in it}. duet-bench reads "text" and ignores the rest. Prints how many documents and bytes per file.
"""
import argparse
import glob
import json
import os
import sys

WS = b" \t\n\r\f\v"


def held_out_docs(data, doc_bytes, held_frac):
    """(source, offset, text) for every document, in file order."""
    files = sorted(glob.glob(os.path.join(data, "*.txt")))
    if not files:
        raise SystemExit(f"accuracy_docs: no *.txt in {data}")
    for fn in files:
        b = open(fn, "rb").read()
        cut = int(len(b) * (1 - held_frac))  # train_demo.py's load_data split
        p = cut
        while p < len(b) and b[p] not in WS:  # finish the word the cut fell into
            p += 1
        while True:
            while p < len(b) and b[p] in WS:
                p += 1
            if p >= len(b):
                break
            end = min(p + doc_bytes, len(b))
            while end < len(b) and b[end] not in WS:
                end += 1
            yield os.path.basename(fn), p, b[p:end].rstrip(WS).decode("utf-8")
            p = end


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--doc-bytes", type=int, default=2000)
    ap.add_argument("--held-frac", type=float, default=0.02)
    ap.add_argument("out")
    a = ap.parse_args(argv)
    if a.doc_bytes < 1 or not 0 < a.held_frac < 1:
        ap.error("--doc-bytes must be >= 1 and --held-frac in (0, 1)")
    counts = {}
    with open(a.out, "w", encoding="utf-8") as f:
        for src, off, text in held_out_docs(a.data, a.doc_bytes, a.held_frac):
            f.write(json.dumps({"text": text, "source": src, "offset": off}) + "\n")
            n, nb = counts.get(src, (0, 0))
            counts[src] = (n + 1, nb + len(text.encode("utf-8")))
    for src, (n, nb) in counts.items():
        print(f"accuracy_docs: {src}: {n} documents, {nb} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
