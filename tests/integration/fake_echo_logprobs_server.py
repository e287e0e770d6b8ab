#!/usr/bin/env python3
"""A FAKE OpenAI completions server for duet-bench's accuracy tests (not a model, not duet).

It answers POST /v1/completions with {"echo": true, "max_tokens": 0, "logprobs": k} the way an
OpenAI-compatible server does, with log-probabilities from a known rule (fake_logprob below) so
the test can compute the expected bits per byte on its own:
  tokens: a BOS token (text "", offset 0, logprob null), then one token per code point;
  text_offset: code-point offsets into choices[0].text (= the prompt);
  token_logprobs[i] = fake_logprob(text, i, worse, noise_seed, noise).
GET /v1/models lists one model, "fake". --mode breaks the answers on purpose (no logprobs, text
generated after the prompt, HTTP 500) for the error paths.

Usage: fake_echo_logprobs_server.py [--worse NATS] [--noise-seed S] [--noise A] [--mode M]
Prints "port N" on stdout once listening on 127.0.0.1 (an ephemeral port), then serves until
killed.
"""
import argparse
import http.server
import json
import random
import sys


def fake_logprob(text, i, worse=0.0, noise_seed=0, noise=0.05):
    """The logprob of code point i (0-based) of text given what precedes it."""
    rng = random.Random(f"{noise_seed}:{i}:{text}")  # str seeds are hashed with SHA-512: stable
    return -(0.5 + (ord(text[i]) % 13) / 10.0) - worse + rng.uniform(-noise, noise)


def answer(prompt, a):
    n = len(prompt)
    lps = [None] + [fake_logprob(prompt, i, a.worse, a.noise_seed, a.noise) for i in range(n)]
    offsets = [0] + list(range(n))
    tokens = ["<bos>"] + list(prompt)
    text = prompt + (" and more" if a.mode == "generate-extra" else "")
    logprobs = {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [None] + [{t: lp} for t, lp in zip(tokens[1:], lps[1:])]}
    return {"id": "cmpl-fake", "object": "text_completion", "model": "fake",
            "choices": [{"index": 0, "text": text, "finish_reason": "length",
                         "logprobs": None if a.mode == "no-logprobs" else logprobs}],
            "usage": {"prompt_tokens": n + 1, "completion_tokens": 0, "total_tokens": n + 1}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worse", type=float, default=0.0)
    p.add_argument("--noise-seed", type=int, default=0)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--mode", choices=["ok", "no-logprobs", "generate-extra", "http500"],
                   default="ok")
    a = p.parse_args()

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/v1/models":
                self.send(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
            else:
                self.send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                return self.send(404, {"error": {"message": "not found"}})
            if a.mode == "http500":
                return self.send(500, {"error": {"message": "fake failure"}})
            if (req.get("echo") is not True or req.get("max_tokens") != 0
                    or not isinstance(req.get("logprobs"), int) or req.get("logprobs") < 0
                    or not isinstance(req.get("prompt"), str)):
                return self.send(400, {"error": {"message": "fake server wants echo, "
                                                 "max_tokens 0, logprobs >= 0, a prompt string"}})
            self.send(200, answer(req["prompt"], a))

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(f"port {srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
