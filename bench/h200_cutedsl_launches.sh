#!/usr/bin/env bash
# The cutedsl experts' two launch paths (dlpack and TVM-FFI) on the H200 in one device call (about 9 minutes):
#
#   run(command="bash bench/h200_cutedsl_fp8.sh half", carry=[".cutedsl/cutedsl.tar.xz.aa"], timeout_s=60)
#   run(command="bash bench/h200_cutedsl_launches.sh", carry=[".cutedsl/cutedsl.tar.xz.ab"], timeout_s=600)
#
# back to back (bench/cutedsl_tvmffi_bundle.sh writes the two halves of the bundle; the first command leaves
# half A in /tmp while the machine stays warm). In order, each step with its own time limit, its output in
# $OUT/<step>.log, a failed step not stopping the next:
#   1. launch_paths: the dlpack and TVM-FFI launches compute the same bits (tests/unit/test_experts_cutedsl.py);
#   2. layer: moe_bench's raw and compiled layer rows at moonlet's expert shape and the 128-expert one, every
#      cutedsl row launched both ways, with the host time of one launch each way;
#   3. profile: kernel tables of the compiled layers at moonlet's shape (grouped_mm, FP8 per launch), each
#      headed by the GPU's busy share of a step (far below 100%: the host's launches set the pace).
set -uo pipefail
source "$(dirname "$0")/cutedsl_device.sh"
cutedsl_unpack
mkdir -p "$out/profile"
STEP_TAIL=60

step launch_paths 150 python3 -m pytest -q --noconftest tests/unit/test_experts_cutedsl.py -k launch_paths
step layer 270 python3 bench/moe_bench.py --layer-only --shapes "1024,512,64,6;2048,768,128,8" \
  --variants raw,raw-cutedsl,compiled,compiled-fp8 --launch both --budget-s 230 --out "$out/moe_bench.json"
step profile 150 python3 bench/moe_bench.py --layer-only --shapes "1024,512,64,6" --variants compiled,compiled-fp8 \
  --launch both --profile --budget-s 110 --out "$out/profile/moe_bench.json"
