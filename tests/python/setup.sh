#!/bin/bash
# Make the tests' Python venv: BUILD_DIR/pyvenv with tests/python/requirements.txt installed.
# Made once and remade only when requirements.txt changes (its copy in the venv is the stamp).
# deploy/test.sh runs this before ctest; a suite that needs the venv and finds it missing fails
# with a message naming this script, it never skips.
# Usage: tests/python/setup.sh BUILD_DIR      (prints the venv's python on stdout)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: tests/python/setup.sh BUILD_DIR}" && pwd)
venv=$build/pyvenv
req=$here/requirements.txt
if [ -x "$venv/bin/python" ] && cmp -s "$req" "$venv/requirements.txt"; then
  echo "$venv/bin/python"
  exit 0
fi
echo "tests/python/setup.sh: making $venv ($(grep -c '==' "$req") pinned packages)" >&2
rm -rf "$venv"
python3 -m venv "$venv" >&2 || { echo "python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
if ! "$venv/bin/pip" install --disable-pip-version-check -q -r "$req" >&2; then
  rm -rf "$venv"
  echo "tests/python/setup.sh: pip could not install $req (is PyPI reachable? proxy settings?)" >&2
  exit 1
fi
cp "$req" "$venv/requirements.txt"
echo "$venv/bin/python"
