#!/bin/bash
# Set up and run duet on this machine: install the build dependencies, build, and start the local
# cluster of deploy/configs/local.yaml (duet-router + 1 duet-ctx + 1 duet-gen serving the bundled
# demo model, models/duet-demo). It waits until every worker registered, prints the endpoint and a
# sample request with its answer, and serves until Ctrl-C, which stops everything.
# Extra arguments go to `duet up` (e.g. another cluster YAML, --once, --log-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target duet duet-router duet-ctx duet-gen
exec build/deploy/launcher/duet up "$@"
