#!/bin/bash
# The official `openai` Python client against duet-router, and `promtool check metrics` on the
# router's /metrics after that traffic.
#
# Starts duet-router (model "m": a byte tokenizer with <|bos|>/<|eos|>, the default chat template)
# with 1 ctx and 2 gen duet-test-worker processes on loopback (ephemeral ports: the router prints
# the ports it bound), runs tests/integration/openai_client_test.py; then a second router (model
# "k": Kimi's specials and Kimi K2's chat template, workers answering with a scripted tool call)
# for tests/integration/openai_tools_test.py; then scrapes the first router's /metrics and
# checks it with promtool. Both routers run with api.key "unused" (from DUET_API_KEY). Every
# process started here is stopped on exit (trap).
#
# The client comes from the tests' venv, BUILD_DIR/pyvenv (tests/python/setup.sh, pinned in
# tests/python/requirements.txt); without it the test FAILS with a clear message, never passes.
#
# Usage: tests/integration/run_openai_client_test.sh BUILD_DIR
# Env:   DUET_KEEP_TEST_DIR=1 keeps the temp dir (logs, model folder, metrics.txt).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: run_openai_client_test.sh BUILD_DIR}" && pwd)
router=$build/router/duet-router
worker=$build/tests/tools/duet-test-worker
for b in "$router" "$worker"; do
  [ -x "$b" ] || { echo "openai_client: $b missing: build first (cmake --build $build)" >&2; exit 1; }
done

fail() { echo "openai_client: FAIL: $*" >&2; exit 1; }

# ---------------------------------------------------------------- the tests' venv (pinned client)
py=$build/pyvenv/bin/python
"$py" -c 'import openai' 2> /dev/null ||
  fail "$build/pyvenv has no openai client: run tests/python/setup.sh $build (deploy/test.sh does)"
command -v promtool > /dev/null ||
  fail "promtool not found: install the Debian package 'prometheus' (deploy/install-deps.sh)"

# ---------------------------------------------------------------- cluster
dir=$(mktemp -d /tmp/duet-openai-client-XXXXXX)
keep=${DUET_KEEP_TEST_DIR:-}
unset DUET_KEEP_TEST_DIR  # the router warns about DUET_* variables it does not know
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2> /dev/null; done
  for p in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2> /dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2> /dev/null
    wait "$p" 2> /dev/null
  done
  if [ -n "$keep" ]; then echo "openai_client: kept $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

printf '{"bos_token_id": 256, "eos_token_id": 257, "model_max_length": 4096}\n' > "$dir/config.json"
printf '{"type": "byte", "specials": ["<|bos|>", "<|eos|>"], "add_bos": true}\n' \
  > "$dir/duet_tokenizer.json"

# api.key from the environment (not the command line): the client's key is "unused"
DUET_API_KEY=unused "$router" --model "$dir" --model.name m --model.fingerprint test --http.port 0 \
  --workers.port 0 --admin.port 0 --admin.insecure-no-token --placement.policy round_robin \
  > "$dir/router.out" 2> "$dir/router.log" &
pids+=($!)
line=""
for _ in $(seq 100); do
  line=$(grep -m1 '^duet-router: serving' "$dir/router.out" 2> /dev/null) && break
  kill -0 "${pids[0]}" 2> /dev/null || break
  sleep 0.1
done
[ -n "$line" ] || { cat "$dir/router.log" >&2; fail "duet-router did not start"; }
# "duet-router: serving m on http 127.0.0.1:P, workers 127.0.0.1:W, admin A"
http_port=$(sed -E 's/.* on http [^,]*:([0-9]+),.*/\1/' <<< "$line")
worker_port=$(sed -E 's/.*, workers [^,]*:([0-9]+),.*/\1/' <<< "$line")
base=http://127.0.0.1:$http_port

for w in ctx:ctx-0 gen:gen-0 gen:gen-1; do
  "$worker" --router "127.0.0.1:$worker_port" --role "${w%%:*}" --name "${w#*:}" \
    --fingerprint test --heartbeat-ms 100 --events "$dir/${w#*:}.events" \
    2> "$dir/${w#*:}.log" &
  pids+=($!)
done
for n in ctx-0 gen-0 gen-1; do
  for _ in $(seq 100); do grep -q '^registered' "$dir/$n.events" 2> /dev/null && break; sleep 0.05; done
  grep -q '^registered' "$dir/$n.events" 2> /dev/null || fail "test worker $n did not register"
done
# GET URL [FILE]: prints the status (000 when unreachable); the body goes to FILE (no curl needed)
get() {
  "$py" - "$@" << 'PY'
import sys, urllib.request, urllib.error
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=10); code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
except OSError:
    code, body = 0, b""
if len(sys.argv) > 2:
    open(sys.argv[2], "wb").write(body)
print(f"{code:03d}")
PY
}
for _ in $(seq 100); do [ "$(get "$base/health")" = 200 ] && break; sleep 0.05; done
[ "$(get "$base/health")" = 200 ] || fail "/health is not 200"

# ---------------------------------------------------------------- 1. the openai client
"$py" "$here/openai_client_test.py" "$base/v1"
rc=$?
if [ $rc -ne 0 ]; then
  echo "--- router.log (tail)" >&2; tail -n 40 "$dir/router.log" >&2
  fail "openai_client_test.py exited $rc"
fi

# ---------------------------------------------------------------- 2. tool calling
# A second router, model "k": a byte tokenizer with Kimi's chat and tool-call specials (ids 256..267
# in this order) and Kimi K2's chat template; its workers answer with a scripted tool call.
mkdir -p "$dir/k"
printf '{"bos_token_id": 256, "eos_token_id": 258, "model_max_length": 4096}\n' > "$dir/k/config.json"
printf '{"type": "byte", "specials": ["<|bos|>", "<|eos|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"], "add_bos": false}\n' \
  > "$dir/k/duet_tokenizer.json"
tmpl=$here/../data/chat_templates/moonshotai-Kimi-K2.jinja
cp "$tmpl" "$dir/k/chat_template.jinja"
# "Let me check." <|tool_calls_section_begin|> <|tool_call_begin|> functions.get_weather:0
# <|tool_call_argument_begin|> {"city": "Paris"} <|tool_call_end|> <|tool_calls_section_end|> <|im_end|>
script=$("$py" -c 'b=lambda s: list(s.encode()); print(",".join(map(str, b("Let me check.") + [263, 265] + b("functions.get_weather:0") + [266] + b("{\"city\": \"Paris\"}") + [267, 264, 258])))')
DUET_API_KEY=unused "$router" --model "$dir/k" --model.name k --model.fingerprint test --http.port 0 \
  --workers.port 0 --admin.port 0 --admin.insecure-no-token \
  > "$dir/k/router.out" 2> "$dir/k/router.log" &
pids+=($!)
kpid=$!
line=""
for _ in $(seq 100); do
  line=$(grep -m1 '^duet-router: serving' "$dir/k/router.out" 2> /dev/null) && break
  kill -0 "$kpid" 2> /dev/null || break
  sleep 0.1
done
[ -n "$line" ] || { cat "$dir/k/router.log" >&2; fail "duet-router (model k) did not start"; }
k_http=$(sed -E 's/.* on http [^,]*:([0-9]+),.*/\1/' <<< "$line")
k_workers=$(sed -E 's/.*, workers [^,]*:([0-9]+),.*/\1/' <<< "$line")
for w in ctx:k-ctx gen:k-gen; do
  "$worker" --router "127.0.0.1:$k_workers" --role "${w%%:*}" --name "${w#*:}" \
    --fingerprint test --heartbeat-ms 100 --events "$dir/${w#*:}.events" \
    --script-ids "$script" --script-unless 263 2> "$dir/${w#*:}.log" &
  pids+=($!)
done
for _ in $(seq 100); do [ "$(get "http://127.0.0.1:$k_http/health")" = 200 ] && break; sleep 0.05; done
"$py" "$here/openai_tools_test.py" "http://127.0.0.1:$k_http/v1" "$tmpl"
rc=$?
if [ $rc -ne 0 ]; then
  echo "--- k/router.log (tail)" >&2; tail -n 40 "$dir/k/router.log" >&2
  fail "openai_tools_test.py exited $rc"
fi

# ---------------------------------------------------------------- 3. promtool on /metrics
[ "$(get "$base/metrics" "$dir/metrics.txt")" = 200 ] || fail "GET /metrics failed"
grep -q '^duet_router_http_requests_total{.*path="/v1/chat/completions"' "$dir/metrics.txt" ||
  fail "/metrics has no chat request counter after the traffic: $dir/metrics.txt"
if ! "$here/../tools/promtool_check.sh" "$dir/metrics.txt"; then
  keep=1
  fail "promtool check metrics rejected the router's /metrics (kept in $dir/metrics.txt)"
fi
echo "openai_client: PASS"
