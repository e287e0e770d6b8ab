#!/bin/bash
# Install the Debian/Ubuntu packages duet needs (idempotent, quiet). Debian 12 (bookworm) is what
# CI runs; Ubuntu 22.04 / 24.04 use the same package names (universe), not tested here.
# Usage: deploy/install-deps.sh [--tests]     (root, or a user with sudo)
#   without flags: what building and running need (compiler, CMake, UCX, libuv, protobuf-c, ...);
#   --tests:       also what only the tests need (Criterion, promtool, matplotlib); deploy/test.sh
#                  passes it.
# The tests' Python venv (openai client, jinja2, tiktoken) is made by tests/python/setup.sh.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config git python3 python3-venv
      libucx-dev ucx-utils libuv1-dev libprotobuf-c-dev protobuf-c-compiler
      libopenmpi-dev openmpi-bin libhttp-parser-dev libjansson-dev
      libyaml-dev libpcre2-dev libxxhash-dev)
case "${1:-}" in
  "") ;;
  --tests) pkgs+=(libcriterion-dev  # the unit and integration suites
                  prometheus        # promtool: router_openai_client checks /metrics with it
                  slurm-wlm munge curl   # test_slurm: `duet sbatch` jobs on a local Slurm
                  python3-matplotlib)    # test_bench_serving runs bench/plot_sweep.py
    ;;
  *) echo "usage: deploy/install-deps.sh [--tests]" >&2; exit 2 ;;
esac
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#pkgs[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
