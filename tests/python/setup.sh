#!/bin/bash
# Make the tests' Python venv: BUILD_DIR/pyvenv with tests/python/requirements.txt and
# requirements-lm-eval.txt installed (--light: the first only; ~0.1 GB against ~1 GB, for a build
# whose suites leave out the lm-eval test, as CI's sanitizer build does).
# Made once and remade only when the requirements change (their copy in the venv is the stamp).
# deploy/test.sh runs this before ctest; a suite that needs the venv and finds it missing fails
# with a message naming this script, it never skips.
# Usage: tests/python/setup.sh BUILD_DIR [--light]     (prints the venv's python on stdout)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: tests/python/setup.sh BUILD_DIR [--light]}" && pwd)
venv=$build/pyvenv
reqs=("$here/requirements.txt")
[ "${2:-}" = "--light" ] || reqs+=("$here/requirements-lm-eval.txt")
want=$(cat "${reqs[@]}")
if [ -x "$venv/bin/python" ] && [ "$want" = "$(cat "$venv/requirements.txt" 2>/dev/null)" ]; then
  echo "$venv/bin/python"
  exit 0
fi
echo "tests/python/setup.sh: making $venv ($(cat "${reqs[@]}" | grep -c '==') pinned packages)" >&2
rm -rf "$venv"
python3 -m venv "$venv" >&2 || { echo "python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
args=()
for r in "${reqs[@]}"; do args+=(-r "$r"); done
if ! "$venv/bin/pip" install --disable-pip-version-check -q "${args[@]}" >&2; then
  rm -rf "$venv"
  echo "tests/python/setup.sh: pip could not install ${reqs[*]} (is PyPI reachable? proxy settings?)" >&2
  exit 1
fi
printf '%s\n' "$want" > "$venv/requirements.txt"
echo "$venv/bin/python"
