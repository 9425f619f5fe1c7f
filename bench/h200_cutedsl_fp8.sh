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
#   1. check: bench/cutedsl_check.py at the 128-expert shape: numerics, every GEMM per schedule (clusters of two
#      CTAs multicasting A, the FP8 scales brought by TMA or loaded by the consumers), the fastest of each kind
#      chosen for the expert layer's forward and forward + backward rows (--skip-layer leaves those out);
#   2. tests: the GPU tests of the CuTeDSL kernels (every schedule computes the default's bits, both launches);
#   3. ncu: Nsight Compute's speed of light, scheduler and warp stall reasons of one FP8 launch per schedule
#      (bench/cutedsl_ncu.py), where the machine lets ncu read the counters; NCU_SCHEDULES= (empty) skips it.
set -uo pipefail
source "$(dirname "$0")/cutedsl_device.sh"
if [ "${1:-}" = half ]; then
  cutedsl_half_a
  exit
fi
cutedsl_unpack

step check 330 env PYTHONUNBUFFERED=1 python3 bench/cutedsl_check.py --deadline-s 320 --out "$out/cutedsl_check.json"
step tests 150 python3 -m pytest -q --noconftest --maxfail=3 tests/unit/test_experts_cutedsl.py tests/unit/test_cutedsl_quant.py
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
stalls='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'
# NCU_SCHEDULES (';'-separated names of bench/cutedsl_ncu.py) picks the launches; empty skips ncu.
IFS=';' read -r -a schedules <<< "${NCU_SCHEDULES-fp8 128x128 s5 cluster2 tma-scales;fp8 128x128 s5 cluster2 global-scales}"
for schedule in "${schedules[@]}"; do
  STEP_TAIL=60 step "ncu_${schedule// /_}" 90 "$ncu" --clock-control none -k regex:GroupedGemm --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --metrics "$stalls" \
    python3 bench/cutedsl_ncu.py "$schedule"
done
