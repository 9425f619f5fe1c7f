# Sourced by the device scripts that run the CuTeDSL kernels (bench/h200_cutedsl_fp8.sh, h200_cutedsl_launches.sh)
# on the GPU machine, with the bundle of bench/cutedsl_tvmffi_bundle.sh in two halves:
#   cutedsl_half_a   (1st command, carrying .cutedsl/cutedsl.tar.xz.aa) keeps half A in /tmp, which the machine
#                    keeps while it stays warm (about 30 s after a command);
#   cutedsl_unpack   (2nd command, carrying .cutedsl/cutedsl.tar.xz.ab) joins the halves, puts the DSL on
#                    PYTHONPATH and prints the GPU;
#   step NAME LIMIT CMD...  runs CMD with a time limit, its output in $OUT/NAME.log, then prints its last
#                    STEP_TAIL lines (default 80) and its exit code; a failed step does not stop the next.
out=${OUT:?run this on the device machine, which sets OUT}

cutedsl_half_a() {
  cp .cutedsl/cutedsl.tar.xz.aa /tmp/ && ls -l /tmp/cutedsl.tar.xz.aa
}

cutedsl_unpack() {
  [ -f /tmp/cutedsl.tar.xz.aa ] || { echo "no /tmp/cutedsl.tar.xz.aa: the machine was given back; send half A again (bench/h200_cutedsl_fp8.sh half)" >&2; exit 2; }
  [ -f .cutedsl/cutedsl.tar.xz.ab ] || { echo "no .cutedsl/cutedsl.tar.xz.ab: carry it" >&2; exit 2; }
  local site
  site=$(mktemp -d) && cat /tmp/cutedsl.tar.xz.aa .cutedsl/cutedsl.tar.xz.ab | tar -C "$site" -xJ || exit 2
  export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:$PWD:${PYTHONPATH:-}"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
}

step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n "${STEP_TAIL:-80}" "$out/$name.log"
  echo "== $name: exit code $rc"
}
