#!/bin/bash
# Set up and run duet on this machine: install the build dependencies, build, and answer a
# prompt with the bundled demo model (models/duet-demo). Until the cluster lands this runs the
# single-process engine, duet-generate; extra arguments go to it (e.g. --prompt "..." --json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target duet-generate
model=${DUET_MODEL:-models/duet-demo}
if [ $# -eq 0 ]; then
  set -- --prompt "The LORD said unto Moses," --max-tokens 120 --temperature 0.7 --top-p 0.9 --seed 1
fi
echo "duet: generating with $model" >&2
exec build/engine/duet-generate --model "$model" "$@"
