#!/bin/bash
# Requests/s of the router's HTTP server core (router/http/http.c) with keep-alive, measured with wrk
# against duet-http-echo on loopback: GET /health and POST /echo (1 KiB), server and wrk pinned to
# different cores when taskset and 2+ cores exist. Each number is the median of REPS runs.
# Usage: bench/http_echo.sh [BUILD_DIR] [SECONDS] [CONNECTIONS] [REPS]
# Needs wrk (apt-get install -y wrk). docs/platform.md "libuv 1.44": loopback numbers are noisy
# (+-15-25% run to run).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
secs=${2:-5}
conns=${3:-50}
reps=${4:-3}
bin=$build/tests/tools/duet-http-echo
[ -x "$bin" ] || { echo "http_echo: build first (cmake --build $build --target duet-http-echo)" >&2; exit 1; }
command -v wrk > /dev/null || { echo "http_echo: wrk not found (apt-get install -y wrk)" >&2; exit 1; }

pin_srv=(); pin_wrk=()
if command -v taskset > /dev/null && [ "$(nproc)" -ge 2 ]; then
  pin_srv=(taskset -c 0); pin_wrk=(taskset -c 1)
fi
out=$(mktemp); lua=$(mktemp --suffix=.lua)
DUET_LOG_LEVEL=error "${pin_srv[@]}" "$bin" --port 0 --max-connections 4096 > "$out" &
srv=$!
trap 'kill -INT $srv 2> /dev/null; wait $srv 2> /dev/null; rm -f "$out" "$lua"' EXIT
for _ in $(seq 50); do grep -q '^port ' "$out" && break; sleep 0.1; done
port=$(awk '/^port /{print $2}' "$out")
[ -n "$port" ] || { echo "http_echo: server did not start" >&2; exit 1; }

body=$(head -c 1024 /dev/zero | tr '\0' 'x')
printf 'wrk.method = "POST"\nwrk.body = "%s"\nwrk.headers["Content-Type"] = "text/plain"\n' "$body" > "$lua"

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
run() { # run <path> [wrk args...] -> requests/s
  local path=$1; shift
  "${pin_wrk[@]}" wrk -t1 -c"$conns" -d"${secs}s" "$@" "http://127.0.0.1:$port$path" |
    awk '/^Requests\/sec:/{print $2}'
}
printf "duet-http-echo, wrk -t1 -c%d -d%ss, keep-alive, median of %d runs%s\n" "$conns" "$secs" \
  "$reps" "${pin_srv:+ (server on cpu 0, wrk on cpu 1)}"
for what in health echo1k; do
  rs=()
  for _ in $(seq "$reps"); do
    if [ $what = health ]; then rs+=("$(run /health)"); else rs+=("$(run /echo -s "$lua")"); fi
  done
  printf "%-8s %12s req/s   (runs: %s)\n" "$what" "$(printf '%s\n' "${rs[@]}" | median)" "${rs[*]}"
done
