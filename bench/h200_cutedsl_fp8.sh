#!/usr/bin/env bash
# The CuTeDSL kernels' schedules on the H200 (or H100) in two device calls made back to back, the bundle in two
# halves (bench/cutedsl_tvmffi_bundle.sh writes .cutedsl/cutedsl.tar.xz.aa and .ab):
#
#   run(command="bash bench/h200_cutedsl_fp8.sh half", carry=[".cutedsl/cutedsl.tar.xz.aa"], timeout_s=60)
#   run(command="bash bench/h200_cutedsl_fp8.sh", carry=[".cutedsl/cutedsl.tar.xz.ab"], timeout_s=600)
#
# The first copies half A to /tmp, which the machine keeps while it stays warm (about 30 s after a command). The
# second joins the halves (bench/cutedsl_device.sh) and runs, each step with its own time limit, its output in
# $OUT/<step>.log, a failed step not stopping the next:
#   1. check: bench/cutedsl_check.py at the 128-expert shape: numerics, every GEMM per schedule (cluster of two
#      CTAs multicasting A, FP8 promotion overlapped with the next k-tile), the fastest of each kind chosen for
#      the expert layer's forward and forward + backward rows;
#   2. tests: the GPU tests of the CuTeDSL kernels (every schedule computes the default's bits, both launches).
set -uo pipefail
source "$(dirname "$0")/cutedsl_device.sh"
if [ "${1:-}" = half ]; then
  cutedsl_half_a
  exit
fi
cutedsl_unpack

step check 320 env PYTHONUNBUFFERED=1 python3 bench/cutedsl_check.py --deadline-s 310 --out "$out/cutedsl_check.json"
step tests 150 python3 -m pytest -q --noconftest -x tests/unit/test_experts_cutedsl.py tests/unit/test_cutedsl_quant.py
