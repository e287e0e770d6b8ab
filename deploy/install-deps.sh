#!/bin/bash
# Install every Debian/Ubuntu package duet needs to build, test and run (idempotent, quiet).
# Usage: sudo deploy/install-deps.sh   (as root it needs no sudo)
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config git python3 python3-venv
      libucx-dev ucx-utils libuv1-dev libprotobuf-c-dev protobuf-c-compiler
      libopenmpi-dev openmpi-bin libcriterion-dev libhttp-parser-dev libjansson-dev
      libyaml-dev libpcre2-dev libxxhash-dev)
pkgs+=(prometheus)  # promtool: the router_openai_client test runs promtool check metrics on /metrics
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
