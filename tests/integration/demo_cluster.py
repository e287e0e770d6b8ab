"""A local duet cluster on the demo model for the integration tests, and their check list.

start_cluster() spawns duet-router, one duet-ctx and two duet-gen (gen-1 speculates with the
draft model MODEL_DIR's sibling duet-demo-draft; round-robin placement, so consecutive requests
land on both gen workers) and waits until the three workers registered; stop_cluster() ends them.
"""
import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request

failures = []


def check(cond, what):
    """Record a failed check (the test goes on, and fails at the end)."""
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@contextlib.contextmanager
def demo_cluster(build, model, tmp, log_level, local_below, worker_args=(), admin_port=None):
    """The cluster's HTTP port while the with-block runs; the processes' logs go to tmp.
    worker_args: more flags for every worker; admin_port: a list that receives the admin API's
    port (no token)."""
    hp, wp, ap = free_port(), free_port(), free_port()
    if admin_port is not None:
        admin_port.append(ap)
    procs = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUET_")}
    env["DUET_LOG_LEVEL"] = log_level

    def spawn(name, argv):
        log = open(f"{tmp}/{name}.log", "w")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))

    try:
        spawn("router", [f"{build}/router/duet-router", "--model", model, "--http.port", str(hp),
                         "--workers.port", str(wp), "--admin.port", str(ap),
                         "--admin.insecure-no-token", "--placement.local_prefill_tokens",
                         str(local_below), "--placement.policy", "round_robin"])
        common = ["--router", f"127.0.0.1:{wp}", "--model", model, "--threads", "1",
                  "--heartbeat_ms", "100", "--device", "cpu", "--cache.page_tokens", "16",
                  "--cache.kv_pages", "256", "--batch.max_seqs", "4", *worker_args]
        draft = os.path.join(os.path.dirname(model), "duet-demo-draft")
        spawn("ctx", [f"{build}/ctx_worker/duet-ctx", "--name", "ctx-0", *common])
        spawn("gen-0", [f"{build}/gen_worker/duet-gen", "--name", "gen-0", *common])
        spawn("gen-1", [f"{build}/gen_worker/duet-gen", "--name", "gen-1", *common,
                        "--spec.method", "draft", "--spec.k", "3", "--spec.draft-model", draft])
        deadline = time.time() + 60
        while time.time() < deadline:  # the three workers registered
            try:
                h = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{hp}/health",
                                                      timeout=5).read())
                if h.get("gen_workers", 0) + h.get("ctx_workers", 0) == 3:
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
