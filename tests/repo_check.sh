#!/bin/bash
# The repository stands alone: no tracked file refers to a folder beside it (a sibling "shared"
# folder the first design documents lived in), every `docs/*.md` a file cites exists, and every
# folder of test or benchmark data names its sources in a README beside the files.
# Usage: tests/repo_check.sh SOURCE_DIR      (a ctest, repo_standalone)
set -uo pipefail
cd "${1:?usage: tests/repo_check.sh SOURCE_DIR}" || exit 2
fail=0
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  files() { git ls-files -z; }
  echo "repo_check: $(git ls-files | wc -l) tracked files"
else  # a tarball of the tree: every file but build outputs
  files() { find . -type f -not -path './build*' -not -path './.git/*' -print0; }
  echo "repo_check: not a git checkout; checking every file outside build*/"
fi
# The pattern is split so that this script does not match itself.
outside='\.\./'"shared"
if hits=$(files | xargs -0 grep -n -I -E "$outside" 2> /dev/null) && [ -n "$hits" ]; then
  echo "repo_check: FAIL: files refer to a folder outside the repository:"
  echo "$hits" | head -20
  fail=1
fi
missing=0
while IFS= read -r ref; do
  if [ ! -f "$ref" ]; then
    echo "repo_check: FAIL: $ref is cited but does not exist:"
    files | xargs -0 grep -n -I -F "$ref" | head -3
    missing=1
  fi
done < <(files | xargs -0 grep -o -h -I -E 'docs/[A-Za-z0-9_-]+\.md' | sort -u)
[ $missing -eq 0 ] || fail=1
for d in data/* tests/data/* tests/fixtures tests/unit/data; do
  [ -d "$d" ] || continue
  if [ ! -f "$d/README.md" ]; then
    echo "repo_check: FAIL: $d has no README.md naming its sources"
    fail=1
  fi
done
[ $fail -eq 0 ] && echo "repo_check: ok (no outside references, cited docs exist, data folders documented)"
exit $fail
