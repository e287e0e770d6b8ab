#!/bin/bash
# The chat-template oracle: every published template in tests/data/chat_templates over every
# conversation there, rendered by jinja2 as transformers configures it (the tests' venv, pinned
# in tests/python/requirements.txt) and by duet-chat-template; the outputs must be equal byte for
# byte, or both must raise (with the same message for raise_exception).
# Without the venv the test FAILS with a clear message, never passes.
#
# Usage: tests/integration/run_chat_template_oracle.sh BUILD_DIR
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
build=$(cd "${1:?usage: run_chat_template_oracle.sh BUILD_DIR}" && pwd)
cli=$build/router/api/duet-chat-template
py=$build/pyvenv/bin/python
[ -x "$cli" ] || { echo "chat_template_oracle: FAIL: $cli missing: build it first" >&2; exit 1; }
"$py" -c 'import jinja2' 2> /dev/null || {
  echo "chat_template_oracle: FAIL: $build/pyvenv has no jinja2: run tests/python/setup.sh $build" \
       "(deploy/test.sh does)" >&2
  exit 1
}
exec "$py" "$src/tests/python/chat_template_oracle.py" "$cli" "$src/tests/data/chat_templates"
