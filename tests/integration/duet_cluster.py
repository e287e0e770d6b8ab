"""A local duet cluster for the Python integration tests, and duet-generate as their reference.

cluster() starts duet-router and its workers on the demo model (CPU, f32, one thread, the same
prefill chunk as generate() gives duet-generate, so batch invariance makes the logits
bit-identical), waits until every worker registered and yields the router's HTTP port; on exit
it stops them all. Their logs stay in the caller's temp dir.

DUET_TEST_DEVICE (default cpu) is the device of the workers and of duet-generate alike: a GPU
machine runs these tests on cuda (bench/gpu_check.sh), equal answers then meaning the cluster
against the same backend alone.
"""
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

CHUNK = "64"
DEVICE = os.environ.get("DUET_TEST_DEVICE", "cpu")


_given_ports = set()


def free_port():
    """A port free now and never given before in this process (the kernel may hand a closed
    socket's ephemeral port out again: two roles on one port would stop a cluster starting)."""
    while True:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        if p not in _given_ports:
            _given_ports.add(p)
            return p


@contextlib.contextmanager
def cluster(build, model, tmp, workers, router_args=(), max_seqs=4, log_level="warn",
            admin_port=None):
    """workers: (name, "ctx" or "gen", extra args) each. The processes get the environment less
    its DUET_* variables, DUET_LOG_LEVEL log_level; logs go to tmp/NAME.log. admin_port: a list
    that receives the admin API's port (no token)."""
    hp, wp, ap = free_port(), free_port(), free_port()
    if admin_port is not None:
        admin_port.append(ap)
    procs = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUET_")}
    env["DUET_LOG_LEVEL"] = log_level

    def spawn(name, argv):
        log = open(f"{tmp}/{name}.log", "w")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))

    binary = {"ctx": f"{build}/ctx_worker/duet-ctx", "gen": f"{build}/gen_worker/duet-gen"}
    try:
        spawn("router", [f"{build}/router/duet-router", "--model", model, "--http.port", str(hp),
                         "--workers.port", str(wp), "--admin.port", str(ap),
                         "--admin.insecure-no-token", *router_args])
        common = ["--router", f"127.0.0.1:{wp}", "--model", model, "--threads", "1",
                  "--batch.prefill_chunk", CHUNK, "--heartbeat_ms", "100", "--device", DEVICE,
                  "--dtype", "f32", "--cache.page_tokens", "16", "--cache.kv_pages", "256",
                  "--batch.max_seqs", str(max_seqs)]
        for name, kind, extra in workers:
            spawn(name, [binary[kind], "--name", name, *common, *extra])
        deadline = time.time() + 60
        while time.time() < deadline:  # every worker registered
            try:
                h = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{hp}/health",
                                                      timeout=5).read())
                if h.get("gen_workers", 0) + h.get("ctx_workers", 0) == len(workers):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        else:
            raise SystemExit(f"the cluster did not come up (logs in {tmp})")
        yield hp
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def served_model(port):
    """The model id the router serves (GET /v1/models)."""
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models",
                                             timeout=10).read())["data"][0]["id"]


def generate(build, model, ids, max_tokens, extra=(), dump=None):
    """duet-generate's greedy run over token ids: its --json object; with dump, its
    --dump-logits file (one float32 row of logits per prompt position)."""
    cmd = [f"{build}/engine/duet-generate", "--model", model, "--tokens", ",".join(map(str, ids)),
           "--max-tokens", str(max_tokens), "--json", "--device", DEVICE, "--dtype", "f32",
           "--threads", "1", "--prefill-chunk", CHUNK, "--temperature", "0", *extra]
    if dump:
        cmd += ["--dump-logits", dump]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, "DUET_LOG_LEVEL": "error"}).stdout
    return json.loads(out)


def log_softmax_at(row, i):
    m = max(row)
    return row[i] - (m + math.log(sum(math.exp(x - m) for x in row)))


failures = []  # the checks that failed, for finish()


def check(cond, what):
    """Record a failed check (the test goes on, and fails at the end, in finish())."""
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def finish(name, failures, tmp):
    """The test's end: exit 1 with the failed checks' count and where the logs stay, or remove
    tmp and say that every check passed."""
    if failures:
        print(f"{len(failures)} check(s) failed (logs in {tmp})")
        sys.exit(1)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: all checks passed")
