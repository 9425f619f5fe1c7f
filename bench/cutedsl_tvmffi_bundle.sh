#!/usr/bin/env bash
# The CuTeDSL bundle for the H200 with apache-tvm-ffi in it, for trainer/experts/cutedsl/grouped.py's
# LAUNCH = "tvm-ffi" (the GPU machine has no tvm_ffi and cannot install packages).
#
#   bash bench/cutedsl_tvmffi_bundle.sh        # writes .cutedsl/cutedsl-tvmffi.tar.xz (about 10 min, one core)
#
# It starts from the plain CuTeDSL bundle (.cutedsl/cutedsl.tar.xz, built by the CuTeDSL bundle tool of the
# development environment, or by hand as docs/h200.md says), drops the DSL's optional `iket` package (cutlass
# imports it under try/except) and adds tvm_ffi for Python 3.12 without its headers, sources, test library and
# third-party trees. The result (64.8 MB on 2026-12-04) still fits beside the project tree in one device call
# (64 MiB in all) with about 100 KB to spare; compress with one thread (-T1): two threads made it 1 MB larger.
# On the GPU machine it unpacks as the plain bundle does:
#   d=$(mktemp -d) && tar -C "$d" -xJf .cutedsl/cutedsl-tvmffi.tar.xz &&
#   export PYTHONPATH="$d:$d/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
set -euo pipefail
cd "$(dirname "$0")/.."
tvm_ffi=${TVM_FFI_VERSION:-0.1.15.post2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The plain bundle, kept beside the checkout once this has run (only one bundle may travel in .cutedsl).
plain=../cutedsl-plain.tar.xz
if [ -f .cutedsl/cutedsl.tar.xz ]; then
  mv .cutedsl/cutedsl.tar.xz "$plain"
elif [ ! -f "$plain" ]; then
  echo "no plain CuTeDSL bundle: build .cutedsl/cutedsl.tar.xz first (docs/h200.md says how)" >&2
  exit 1
fi
mkdir -p "$work/site" "$work/whl"
tar -C "$work/site" -xJf "$plain"
rm -rf "$work/site/nvidia_cutlass_dsl/dsl_packages/iket"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$work/whl" "apache-tvm-ffi==$tvm_ffi"
python3 -m zipfile -e "$work"/whl/apache_tvm_ffi-*.whl "$work/site"
rm -rf "$work/site/tvm_ffi/include" "$work/site/tvm_ffi/src" "$work/site/tvm_ffi/3rdparty" \
       "$work/site/tvm_ffi/cmake" "$work/site/tvm_ffi/share" "$work/site/tvm_ffi/lib/libtvm_ffi_testing.so"
tar -C "$work/site" -cf - . | xz -9e -T1 > .cutedsl/cutedsl-tvmffi.tar.xz
ls -l .cutedsl/cutedsl-tvmffi.tar.xz
