#!/bin/bash
# Run duet's libFuzzer targets (docs/fuzzing.md) and report what they found.
#
# Usage: fuzz/run.sh BUILD_DIR [--seconds S | --runs N] [--jobs J] [--work DIR] [TARGET...]
#   BUILD_DIR   a build configured with -DDUET_FUZZ=ON (CC=clang) and built with
#               `cmake --build BUILD_DIR --target duet_fuzz`
#   --seconds S fuzz each target for S seconds of wall time (default 10)
#   --runs N    or until N inputs ran, counted over all jobs (the full run: --runs 10000000)
#   --jobs J    J processes per target on one shared corpus (default 1)
#   --work DIR  where the corpus copies, logs and reproducers go (default: a fresh temporary
#               folder, removed afterwards when nothing was found)
#   TARGET      fuzz_<TARGET> names (default: every fuzz_* in BUILD_DIR/fuzz)
# Environment: FUZZ_TIMEOUT (seconds one input may take, default 10), FUZZ_RSS_MB (memory limit
# per process, default 2048), FUZZ_EXTRA (more libFuzzer flags).
#
# Each target runs on a copy of its seeds (fuzz/corpus/<target>) and stored findings
# (fuzz/regressions/<target>); nothing is written into the repository. Prints one line per
# target (executions, seconds, exec/s, result) and exits 1 when any target crashed, hung, leaked
# or tripped a sanitizer or an invariant, printing where the reproducer was kept; copy it to
# fuzz/regressions/<target>/ once the decoder is fixed (docs/fuzzing.md).
set -uo pipefail

usage() {
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

[ $# -ge 1 ] || usage
build=$1
shift
seconds=10
runs=""
jobs=1
work=""
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
    --seconds) seconds=${2:?}; runs=""; shift 2 ;;
    --runs) runs=${2:?}; shift 2 ;;
    --jobs) jobs=${2:?}; shift 2 ;;
    --work) work=${2:?}; shift 2 ;;
    -h | --help) usage ;;
    -*) echo "run.sh: unknown option $1" >&2; usage ;;
    *) targets+=("${1#fuzz_}"); shift ;;
    esac
done
case "$jobs$seconds${runs:-0}" in *[!0-9]*) echo "run.sh: --jobs, --seconds, --runs take numbers" >&2; exit 2 ;; esac
[ "$jobs" -ge 1 ] || { echo "run.sh: --jobs must be at least 1" >&2; exit 2; }

src=$(cd "$(dirname "$0")/.." && pwd)
bin=$build/fuzz
if [ ${#targets[@]} -eq 0 ]; then
    for f in "$bin"/fuzz_*; do
        [ -x "$f" ] && targets+=("$(basename "$f" | sed 's/^fuzz_//')")
    done
fi
[ ${#targets[@]} -gt 0 ] || { echo "run.sh: no fuzz_* targets in $bin (configure with -DDUET_FUZZ=ON, build --target duet_fuzz)" >&2; exit 2; }

own_work=0
if [ -z "$work" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/duet-fuzz.XXXXXX")
    own_work=1
fi
mkdir -p "$work"
timeout_s=${FUZZ_TIMEOUT:-10}
rss_mb=${FUZZ_RSS_MB:-2048}

# The dictionary of a target, when it has one.
dict_of() {
    case "$1" in
    http | admin | openai | jinja | model_config | safetensors | tiktoken) echo "$src/fuzz/dict/$1.dict" ;;
    chat_template) echo "$src/fuzz/dict/openai.dict" ;;
    config_yaml | cluster) echo "$src/fuzz/dict/yaml.dict" ;;
    esac
}

# What a log says went wrong ("" when nothing).
verdict() {
    local log=$1
    if grep -q "ERROR: libFuzzer: timeout" "$log"; then echo "HANG"
    elif grep -q "ERROR: LeakSanitizer" "$log"; then echo "LEAK"
    elif grep -q "ERROR: libFuzzer: out-of-memory\|ERROR: libFuzzer: malloc" "$log"; then echo "OOM"
    elif grep -q "ERROR: AddressSanitizer" "$log"; then echo "ASAN"
    elif grep -q "runtime error:" "$log"; then echo "UBSAN"
    elif grep -q "invariant failed" "$log"; then echo "INVARIANT"
    elif grep -q "ERROR: libFuzzer\|==ERROR\|SUMMARY: " "$log"; then echo "CRASH"
    fi
}

printf '%-14s %13s %9s %10s  %s\n' target executions seconds exec/s result
failed=0
total_start=$(date +%s)
for t in "${targets[@]}"; do
    exe=$bin/fuzz_$t
    if [ ! -x "$exe" ]; then
        printf '%-14s %13s %9s %10s  %s\n' "$t" - - - "MISSING ($exe)"
        failed=1
        continue
    fi
    tw=$work/$t
    mkdir -p "$tw/corpus" "$tw/artifacts"
    for d in "$src/fuzz/corpus/$t" "$src/fuzz/regressions/$t"; do
        [ -d "$d" ] && find "$d" -maxdepth 1 -type f ! -name README.md -exec cp {} "$tw/corpus/" \;
    done
    flags=(-timeout="$timeout_s" -rss_limit_mb="$rss_mb" -malloc_limit_mb="$rss_mb"
           -artifact_prefix="$tw/artifacts/" -close_fd_mask=2 -print_final_stats=1)
    dict=$(dict_of "$t")
    [ -n "$dict" ] && flags+=(-dict="$dict")
    if [ -n "$runs" ]; then
        flags+=(-runs=$(((runs + jobs - 1) / jobs)))
    else
        flags+=(-max_total_time="$seconds")
    fi
    # shellcheck disable=SC2206
    [ -n "${FUZZ_EXTRA:-}" ] && flags+=($FUZZ_EXTRA)
    start_ms=$(($(date +%s%N) / 1000000))
    pids=()
    for ((j = 0; j < jobs; j++)); do
        "$exe" "${flags[@]}" "$tw/corpus" > "$tw/log.$j" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    ms=$(($(date +%s%N) / 1000000 - start_ms))
    [ "$ms" -gt 0 ] || ms=1
    execs=0
    result=OK
    for ((j = 0; j < jobs; j++)); do
        log=$tw/log.$j
        # "Done N runs" at a clean end, else the last status line's #N
        n=$(grep -o '^Done [0-9]*' "$log" | tail -1 | grep -o '[0-9]*$')
        [ -n "$n" ] || n=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
        execs=$((execs + ${n:-0}))
        v=$(verdict "$log")
        if [ -n "$v" ]; then
            result=$v
            failed=1
        fi
    done
    printf '%-14s %13d %7d.%d %10d  %s\n' "$t" "$execs" $((ms / 1000)) $((ms % 1000 / 100)) \
        $((execs * 1000 / ms)) "$result"
    if [ "$result" != OK ]; then
        for f in "$tw"/artifacts/*; do
            [ -e "$f" ] && echo "    reproducer: $f (replay: $exe $f)"
        done
        for ((j = 0; j < jobs; j++)); do
            [ -n "$(verdict "$tw/log.$j")" ] && echo "    log: $tw/log.$j" &&
                grep -m1 -A3 "ERROR:\|runtime error:\|invariant failed" "$tw/log.$j" | sed 's/^/      /'
        done
    fi
done
echo "total: $(($(date +%s) - total_start)) s"
if [ $failed -ne 0 ]; then
    echo "fuzz: findings kept in $work" >&2
    exit 1
fi
[ $own_work -eq 1 ] && rm -rf "$work"
exit 0
