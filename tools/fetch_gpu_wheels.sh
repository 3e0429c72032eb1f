#!/usr/bin/env bash
# Download the wheels an offline GPU machine needs for the flashinfer attention backend into
# .whl/ (ignored by git; add `/.whl/` to .git/info/exclude once), to be carried there and
# installed with
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Why these two and no others: `import flashinfer` needs, outside try/except, only torch,
# apache-tvm-ffi (tvm_ffi), filelock, jinja2, numpy, packaging, nvidia-ml-py (pynvml),
# requests and tqdm (checked by importing it with every other package hidden); the GPU image
# has all of them but apache-tvm-ffi. The kernels are JIT-compiled there by nvcc and ninja,
# so the flashinfer wheel is pure Python plus CUDA sources.
#
# Why 0.7.0.post1: a device call carries at most 64 MiB of working tree. 0.7.2.post1 is
# 59.2 MiB alone; 0.7.0.post1 (32.1 MiB) plus apache-tvm-ffi (3.2 MiB) leaves about 25 MiB
# for the repository, _core.so and anything else a run carries. The wheel is used as
# published (no repacking), so its RECORD hashes still match.
#
# Usage: tools/fetch_gpu_wheels.sh [DEST]   (DEST defaults to .whl in the repository root)
set -euo pipefail

FLASHINFER_VERSION=0.7.0.post1
TVM_FFI_VERSION=0.1.15.post2

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/.whl}"
mkdir -p "$dest"

# The GPU image runs CPython 3.12 on x86-64 (glibc 2.28 or newer).
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" \
    "flashinfer-python==$FLASHINFER_VERSION" \
    "apache-tvm-ffi==$TVM_FFI_VERSION"

# Two versions of one package stop `pip install --no-deps` there: keep only these.
for f in "$dest"/*.whl; do
    case "$(basename "$f")" in
        flashinfer_python-"$FLASHINFER_VERSION"-*.whl) ;;
        apache_tvm_ffi-"$TVM_FFI_VERSION"-*.whl) ;;
        *) echo "removing $(basename "$f") (not one of the pinned wheels)"; rm -f "$f" ;;
    esac
done

ls -l "$dest"
du -cb "$dest"/*.whl | awk 'END { printf "total: %d bytes (%.1f MiB)\n", $1, $1 / 1048576 }'
