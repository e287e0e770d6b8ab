#!/bin/bash
# Runs tests/unit/tokenizer_kimi_oracle.py (Kimi's tokenizer in duet against tiktoken with
# tokenization_kimi.py's rules) with the tests' venv, BUILD_DIR/pyvenv (tests/python/setup.sh,
# tiktoken pinned in tests/python/requirements.txt). Without the venv the test FAILS, naming the
# script that makes it; it never skips.
# Usage: tests/unit/run_tokenizer_kimi_oracle.sh BUILD_DIR DRIVER
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: run_tokenizer_kimi_oracle.sh BUILD_DIR DRIVER}
driver=${2:?usage: run_tokenizer_kimi_oracle.sh BUILD_DIR DRIVER}
py=$build/pyvenv/bin/python
if ! "$py" -c 'import tiktoken' 2> /dev/null; then
  echo "tokenizer_kimi_oracle: FAIL: $build/pyvenv has no tiktoken: run tests/python/setup.sh $build" \
       "(deploy/test.sh does)" >&2
  exit 1
fi
[ -x "$driver" ] || { echo "tokenizer_kimi_oracle: FAIL: $driver missing: build first" >&2; exit 1; }
exec "$py" "$here/tokenizer_kimi_oracle.py" "$driver" "$here/../.."
