#!/bin/bash
# The CUDA backend's checks and benchmarks on a GPU machine, in one command (issue 6):
#   build → every CUDA kernel test against the CPU path → the engine against transformers'
#   fixtures (f32 and bf16) → the local cluster with GPU workers → duet-bench-model-cuda at
#   Kimi-Linear-48B's dimensions (27 and 8 layers) → transformers' KimiLinearForCausalLM at the
#   same dimensions, right after, on the same GPU (tools/bench_transformers.py); and the floor of
#   the engine's batch-1 kernel sequence made of pure weight streams (duet-bench-launch-floor).
# Usage: bench/gpu_check.sh [OUT_DIR]   (default: ./gpu-check-out)
# Env: DEPS=DIR of carried .deb files (the GPU machine lacks libuv etc.: tools/gpu_deps.sh),
#      PY=python with torch + transformers (default: the first of /opt/torch/.venv/bin/python3,
#      python3), STAGES="build tests cluster bench tf" to run a subset (add `pycluster` for the
#      Python cluster tests on cuda, `trace` for the
#      27-layer batch-1 step's per-kernel table under the CUPTI tracer), TARGETS="..." to build
#      only some targets, CUDA_UCX=DIR a CUDA-built UCX (tools/build_ucx_cuda.sh): the tests
#      stage then also runs transfer_cuda and the cluster's greedy test with it, the workers'
#      transfers moving the device pools directly (transfer.device_pools=auto,
#      UCX_TLS=self,sm,cuda_copy,cuda_ipc).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check-out}
mkdir -p "$out"
stages=${STAGES:-build tests cluster bench tf}
py=${PY:-$( [ -x /opt/torch/.venv/bin/python3 ] && echo /opt/torch/.venv/bin/python3 || echo python3)}
if [ -n "${DEPS:-}" ]; then eval "$(bash tools/gpu_deps.sh unpack "$DEPS")"; fi
export PATH=/usr/local/cuda/bin:$PATH
has() { case " $stages " in *" $1 "*) return 0;; esac; return 1; }
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$out/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# transformers' eager step launches its kernels one at a time from one Python thread, so the host
# CPU may set its pace: record it beside the GPU.
{ grep -m1 "model name" /proc/cpuinfo; echo "cpus $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"; } | tee -a "$out/gpu.txt"

if has build; then
  say build
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 \
    >"$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
  cmake --build build-gpu -j"$(nproc)" ${TARGETS:+--target $TARGETS} >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
fi
if has tests; then
  for t in test_kernels_cuda test_cuda_kda test_cuda_mla test_cuda_mla_x test_cuda_ops test_engine_cuda \
      test_cuda_arch transfer_cuda; do
    bin=$(find build-gpu/tests -name "$t" -type f | head -1)
    [ -n "$bin" ] || { say "$t: not built"; continue; }
    say "$t"
    "$bin" --verbose=0 -j1 >"$out/$t.log" 2>&1; rc=$?
    grep -E "max|rel L2|err|Synthesis|FAIL|fail|equal|tokens|differ|identical" "$out/$t.log" | grep -v "INFO" | tail -40
    say "$t exit $rc"
  done
fi
if has tests && [ -n "${CUDA_UCX:-}" ]; then
  ucx_lib=$(cd "$CUDA_UCX" && pwd)/lib
  say "transfer_cuda with the CUDA-built UCX ($CUDA_UCX)"
  LD_LIBRARY_PATH=$ucx_lib:${LD_LIBRARY_PATH:-} build-gpu/tests/transfer_cuda --verbose=0 -j1 \
    >"$out/transfer_cuda_ucx.log" 2>&1; rc=$?
  grep -E "transfer_cuda |Synthesis|FAIL|SKIP" "$out/transfer_cuda_ucx.log" | tail -12
  say "transfer_cuda (CUDA UCX) exit $rc"
  say "cluster greedy test, transfers moving the device pools (CUDA UCX)"
  DUET_TRANSFER_DEVICE_POOLS=auto DUET_TEST_UCX_TLS=self,sm,cuda_copy,cuda_ipc \
    DUET_TEST_EXPECT_DEVICE_POOLS=1 \
    LD_LIBRARY_PATH=$ucx_lib:${LD_LIBRARY_PATH:-} timeout 300 build-gpu/tests/test_cluster \
    --verbose=0 -j1 --filter 'cluster/greedy*' >"$out/test_cluster_devpools.log" 2>&1; rc=$?
  grep -E "cluster:|Synthesis|FAIL" "$out/test_cluster_devpools.log" | tail -8
  say "test_cluster greedy (device pools) exit $rc"
fi
if has cluster; then
  say "cluster (GPU workers: --device auto picks cuda)"
  bin=$(find build-gpu/tests -name test_cluster -type f | head -1)
  timeout "${CLUSTER_TIMEOUT:-400}" "$bin" --verbose=0 -j1 ${CLUSTER_FILTER:+--filter "$CLUSTER_FILTER"} \
    >"$out/test_cluster.log" 2>&1; rc=$?
  grep -E "Synthesis|FAIL|fail|\[----\]" "$out/test_cluster.log" | tail -30
  say "test_cluster exit $rc"
fi
if has pycluster; then
  # the Python cluster tests that run on any device (tests/integration/duet_cluster.py)
  for t in prefix_cache_cluster; do
    say "$t (DUET_TEST_DEVICE=cuda)"
    DUET_TEST_DEVICE=cuda timeout 300 "$py" "tests/integration/${t}_test.py" build-gpu \
      models/duet-demo >"$out/$t.log" 2>&1; rc=$?
    tail -5 "$out/$t.log"
    say "$t exit $rc"
  done
fi
if has bench; then
  say "duet-bench-model-cuda 27 layers"
  build-gpu/bench/duet-bench-model-cuda --config bench/configs/kimi-linear-48b --layers 27 \
    2>"$out/bench27.err" | tee "$out/bench27.jsonl"
  tail -3 "$out/bench27.err"
  say "duet-bench-model-cuda 8 layers"
  build-gpu/bench/duet-bench-model-cuda --config bench/configs/kimi-linear-48b --layers 8 \
    2>"$out/bench8.err" | tee "$out/bench8.jsonl"
  tail -3 "$out/bench8.err"
  for C in 2048 32768; do
    say "duet-bench-launch-floor 27 layers, context $C (the engine's kernel sequence as pure streams)"
    build-gpu/bench/duet-bench-launch-floor --config bench/configs/kimi-linear-48b --layers 27 \
      --context "$C" | tee "$out/floor27_$C.jsonl"
  done
fi
if has trace; then
  lib=build-gpu/bench/libduet-cupti-trace.so
  if [ -f "$lib" ]; then
    say "duet-bench-model-cuda 27 layers, batch 1, under the CUPTI tracer (tools/trace_step.py)"
    CUDA_INJECTION64_PATH="$PWD/$lib" DUET_TRACE_OUT="$out/trace27.tsv" \
      build-gpu/bench/duet-bench-model-cuda --config bench/configs/kimi-linear-48b --layers 27 \
      --batch 1 --context 2048,32768 --prefill 0 --steps 30 2>"$out/trace27.err" | tee "$out/trace27.jsonl"
    "$py" tools/trace_step.py "$out/trace27.tsv" --detail >"$out/trace27.txt"
    grep -A16 "^graph" "$out/trace27.txt"
    gzip -f "$out/trace27.tsv"
  else
    say "trace: $lib not built (no CUPTI)"
  fi
fi
if has tf; then
  for L in 27 8; do
    say "transformers $L layers"
    timeout 400 "$py" tools/bench_transformers.py --layers "$L" --steps 20 2>"$out/tf$L.err" | tee "$out/tf$L.jsonl"
    tail -3 "$out/tf$L.err"
  done
fi
say done
