#!/usr/bin/env bash
# The CuTeDSL bundle for the GPU machine, with apache-tvm-ffi in it (trainer/experts/cutedsl/grouped.py launches
# through TVM-FFI by default), in two halves that travel in two device commands made back to back.
#
#   bash bench/cutedsl_tvmffi_bundle.sh        # writes .cutedsl/cutedsl.tar.xz.aa and .ab (a few minutes)
#
# The GPU machine has no cutlass-dsl and no tvm_ffi and cannot install packages, and one command there receives
# at most 64 MiB of files. So: download the wheels for Python 3.12 here, keep what JIT use needs, compress, and
# split in two. tvm_ffi's lib/libtvm_ffi_testing.so stays: tvm_ffi loads it at import (a bundle without it
# fails with "libtvm_ffi_testing.so: cannot open shared object file"). The halves go as docs/h200.md says:
#   1st command, carrying .cutedsl/cutedsl.tar.xz.aa:  cp .cutedsl/cutedsl.tar.xz.aa /tmp/
#   2nd command (while the machine is warm), carrying .cutedsl/cutedsl.tar.xz.ab:
#     d=$(mktemp -d) && cat /tmp/cutedsl.tar.xz.aa .cutedsl/cutedsl.tar.xz.ab | tar -C "$d" -xJ &&
#     export PYTHONPATH="$d:$d/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
# .cutedsl/ is ignored by git. The bundle is for running on that machine only; the DSL's license does not allow
# redistributing it.
set -euo pipefail
cd "$(dirname "$0")/.."
dsl=${CUTLASS_DSL_VERSION:-4.8.1}
tvm_ffi=${TVM_FFI_VERSION:-0.1.15.post2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$work/whl" "nvidia-cutlass-dsl==$dsl" "nvidia-cutlass-dsl-libs-base==$dsl" \
  "nvidia-cutlass-dsl-libs-core==$dsl" "nvidia-cutlass-dsl-libs-cu13==$dsl" "apache-tvm-ffi==$tvm_ffi"
mkdir -p "$work/site" .cutedsl
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
# Not needed to JIT-compile and launch kernels: the profiler injection library and `iket` (imported under
# try/except), cross-target stubs, the static runtime archive; tvm_ffi's headers, sources and build files.
rm -rf "$work/site/nvidia_cutlass_dsl/dsl_packages/iket" \
       "$work/site/nvidia_cutlass_dsl/cu13/lib/stubs" \
       "$work/site/nvidia_cutlass_dsl/cu13/lib/libcuda_dialect_runtime_static.a" \
       "$work/site/tvm_ffi/include" "$work/site/tvm_ffi/src" "$work/site/tvm_ffi/3rdparty" \
       "$work/site/tvm_ffi/cmake" "$work/site/tvm_ffi/share"
test -f "$work/site/tvm_ffi/lib/libtvm_ffi_testing.so" || { echo "tvm_ffi lost libtvm_ffi_testing.so" >&2; exit 1; }
rm -f .cutedsl/cutedsl.tar.xz.*
tar -C "$work/site" -cf - . | xz -6 -T2 > "$work/cutedsl.tar.xz"
half=$(( ($(stat -c %s "$work/cutedsl.tar.xz") + 1) / 2 ))
split -b "$half" "$work/cutedsl.tar.xz" .cutedsl/cutedsl.tar.xz.
ls -l .cutedsl/
