#!/bin/bash
# Build duet and run every test suite (the README's test command; CI runs exactly this).
# Installs the packages (deploy/install-deps.sh --tests) and the tests' Python venv
# (tests/python/setup.sh) first. Warnings are errors here (DUET_WERROR), not in a user's build.
# Usage: deploy/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh --tests
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDUET_BUILD_TESTS=ON \
      -DDUET_WERROR=ON >/dev/null
cmake --build build -j"$(nproc)"
bash tests/python/setup.sh build >/dev/null
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
