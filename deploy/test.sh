#!/bin/bash
# Build duet and run every test suite (the README's test command; CI runs exactly this).
# Usage: deploy/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
