#!/usr/bin/env bash
# The CuTeDSL kernels' schedules on the H200 (or H100) in two device calls made back to back, the bundle in two
# halves (bench/cutedsl_tvmffi_bundle.sh writes .cutedsl/cutedsl.tar.xz.aa and .ab):
#
#   run(command="bash bench/h200_cutedsl_fp8.sh half", carry=[".cutedsl/cutedsl.tar.xz.aa"], timeout_s=60)
#   run(command="bash bench/h200_cutedsl_fp8.sh", carry=[".cutedsl/cutedsl.tar.xz.ab"], timeout_s=600)
#
# The first copies half A to /tmp, which the machine keeps while it stays warm (about 30 s after a command). The
# second joins the halves and runs, each step with its own time limit, its output in $OUT/<step>.log, a failed
# step not stopping the next:
#   1. check: bench/cutedsl_check.py at the 128-expert shape: numerics, every GEMM per schedule (cluster of two
#      CTAs multicasting A, FP8 promotion overlapped with the next k-tile), the fastest of each kind chosen for
#      the expert layer's forward and forward + backward rows;
#   2. tests: the GPU tests of the CuTeDSL kernels (every schedule computes the default's bits, both launches).
set -uo pipefail
out=${OUT:?run this on the device machine, which sets OUT}
if [ "${1:-}" = half ]; then
  cp .cutedsl/cutedsl.tar.xz.aa /tmp/ && ls -l /tmp/cutedsl.tar.xz.aa
  exit
fi
[ -f /tmp/cutedsl.tar.xz.aa ] || { echo "no /tmp/cutedsl.tar.xz.aa: the machine was given back; send half A again" >&2; exit 2; }
[ -f .cutedsl/cutedsl.tar.xz.ab ] || { echo "no .cutedsl/cutedsl.tar.xz.ab: carry it" >&2; exit 2; }
site=$(mktemp -d) && cat /tmp/cutedsl.tar.xz.aa .cutedsl/cutedsl.tar.xz.ab | tar -C "$site" -xJ || exit 2
export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader

step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 80 "$out/$name.log"
  echo "== $name: exit code $rc"
}

step check 320 env PYTHONUNBUFFERED=1 python3 bench/cutedsl_check.py --deadline-s 310 --out "$out/cutedsl_check.json"
step tests 150 python3 -m pytest -q --noconftest -x tests/unit/test_experts_cutedsl.py tests/unit/test_cutedsl_quant.py
