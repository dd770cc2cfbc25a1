#!/usr/bin/env bash
# FlashAttention-4 for the GPU machine, which has no network and takes at most 64 MiB of ignored
# files per command (../shared/gpu/README.md, "Wheels larger than 64 MiB").
#
# Here (once per checkout): `bash scripts/fa4_parts.sh` downloads the wheels and splits them into
#   .fa4a/  the small wheels and the first part of nvidia-cutlass-dsl-libs-cu13 (about 92 MB);
#   .fa4b/  the rest of it and its sha256.
# .fa4a is sized to travel together with ./.whl (without Ray) and the tracked tree.
#
# On the device, two commands back to back (the machine keeps /tmp only while it is held):
#   1. carry [".whl", ".fa4a"]:  bash scripts/fa4_parts.sh stash
#   2. carry [".fa4b"]:          bash scripts/fa4_parts.sh install && \
#        export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
# `install` unzips every wheel (the project's .whl too) into /tmp/site: pip --target would skip the
# CuTe DSL's second top-level folder, and the wheel's .pth file is not read from such a folder.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
big=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl

case "${1:-fetch}" in
fetch)
  for d in .fa4a .fa4b; do
    grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
  done
  rm -rf .fa4a .fa4b /tmp/fa4_dl && mkdir -p .fa4a .fa4b /tmp/fa4_dl
  plat=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
  python3 -m pip download -q --no-deps "${plat[@]}" -d /tmp/fa4_dl --pre "flash-attn-4==4.0.0b36"
  python3 -m pip download -q --no-deps "${plat[@]}" -d /tmp/fa4_dl \
    nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
    nvidia-cutlass-dsl-libs-cu13==4.8.1 "cuda-bindings>=13,<14" cuda-pathfinder quack-kernels \
    apache-tvm-ffi torch-c-dlpack-ext einops protobuf
  mv /tmp/fa4_dl/"$big" /tmp/fa4_big.whl
  mv /tmp/fa4_dl/*.whl .fa4a/
  # What .fa4a may still hold beside .whl and the tracked tree, with 0.5 MB to spare.
  tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
  room=$(( 64 * 1024 * 1024 - tree - $(du -cb .whl | tail -1 | cut -f1) - $(du -cb .fa4a | tail -1 | cut -f1) - 500000 ))
  head -c "$room" /tmp/fa4_big.whl > .fa4a/big.part1
  tail -c +"$(( room + 1 ))" /tmp/fa4_big.whl > .fa4b/big.part2
  (cd /tmp && sha256sum fa4_big.whl | sed "s/fa4_big.whl/$big/") > .fa4b/big.sha256
  du -cb .whl .fa4a | tail -1
  du -cb .fa4b | tail -1
  ;;
stash)
  mkdir -p /tmp/parts && cp .whl/*.whl .fa4a/* /tmp/parts/
  ;;
install)
  cp .fa4b/* /tmp/parts/
  cd /tmp/parts
  cat big.part1 big.part2 > "$big" && sha256sum -c big.sha256 && rm big.part1 big.part2
  mkdir -p /tmp/site
  for w in /tmp/parts/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
  ;;
*)
  echo "usage: $0 [fetch|stash|install]" >&2
  exit 2
  ;;
esac
