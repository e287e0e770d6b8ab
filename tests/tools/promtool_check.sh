#!/usr/bin/env bash
# promtool_check.sh FILE: `promtool check metrics` on a /metrics exposition in FILE, the one check
# every test of duet's /metrics runs. promtool's lint reports a metric name with a colon ("metric
# names should not contain ':'"), and duet exports vLLM's names (vllm:*) on purpose (vLLM's own
# /metrics gets the same report): those lines, and only those, are allowed; any other complaint
# (a parse error, a counter without _total, a bad label) fails. Exit 0 when clean, 1 otherwise,
# 2 without promtool (install the Debian package prometheus: deploy/install-deps.sh --tests).
set -u
file=${1:?usage: promtool_check.sh FILE}
command -v promtool > /dev/null || {
  echo "promtool not found: install the Debian package prometheus (deploy/install-deps.sh --tests)" >&2
  exit 2
}
out=$(promtool check metrics < "$file" 2>&1)
rc=$?
other=$(printf '%s\n' "$out" | grep -v '^$' |
  grep -Ev "^vllm:[a-zA-Z0-9_:]+ metric names should not contain ':'$")
if [ -n "$other" ] || { [ $rc -ne 0 ] && [ $rc -ne 3 ]; }; then
  echo "promtool check metrics rejected $file (exit $rc):" >&2
  printf '%s\n' "$other" >&2
  exit 1
fi
# a file without a single sample would pass the lint: say how many were checked
echo "promtool check metrics: ok ($(grep -vc '^#' "$file") samples)"
