#!/bin/bash
# A rank that dies (kill -9) must not leave its group hanging: runs test_comm_mpi --kill as N
# ranks, where the last rank SIGKILLs itself mid-loop while the others loop on collectives, and
# checks that mpirun returns nonzero within LIMIT_S seconds, that the victim did get to kill
# itself (the job did not fail for another reason), and that no rank of this job is left running.
# Usage: tests/group/kill_rank.sh MPIRUN TEST_COMM_MPI N      (a ctest, group_comm_mpi_kill)
set -uo pipefail
mpirun=${1:?usage: kill_rank.sh MPIRUN TEST_COMM_MPI N}
bin=${2:?usage: kill_rank.sh MPIRUN TEST_COMM_MPI N}
n=${3:?usage: kill_rank.sh MPIRUN TEST_COMM_MPI N}
LIMIT_S=15
tag="kill-$$-$RANDOM" # marks this job's processes for the leftover check
log=$(mktemp)
trap 'rm -f "$log"' EXIT

start=$(date +%s.%N)
timeout -k 5 $((LIMIT_S + 30)) "$mpirun" --oversubscribe --allow-run-as-root -n "$n" \
  "$bin" --kill "$tag" > "$log" 2>&1
rc=$?
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
cat "$log"
echo "kill_rank: mpirun returned $rc after ${elapsed} s"

fail=0
if [ "$rc" -eq 0 ]; then
  echo "kill_rank: FAIL: mpirun returned 0 although a rank was killed"
  fail=1
fi
if [ "$rc" -eq 124 ]; then # timeout's status (mpirun's own for a killed rank is 128 + 9)
  echo "kill_rank: FAIL: mpirun itself had to be stopped (it hung)"
  fail=1
fi
if [ "$(echo "$elapsed > $LIMIT_S" | bc)" -eq 1 ]; then
  echo "kill_rank: FAIL: the job took ${elapsed} s to end (limit ${LIMIT_S} s)"
  fail=1
fi
if ! grep -q "killing myself at iteration" "$log"; then
  echo "kill_rank: FAIL: the victim never reached its kill: the job failed for another reason"
  fail=1
fi
sleep 0.2
left=$(pgrep -f -- "--kill $tag" || true)
if [ -n "$left" ]; then
  echo "kill_rank: FAIL: ranks left running after mpirun returned:"
  ps -o pid,etime,args -p $left
  kill -9 $left 2> /dev/null # this job's own processes
  fail=1
fi
[ $fail -eq 0 ] && echo "kill_rank: ok (mpirun ended the job nonzero in ${elapsed} s, no rank left)"
exit $fail
