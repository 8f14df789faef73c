#!/usr/bin/env bash
# Build Horovod 0.28.1 with PyTorch and Gloo (no MPI, no GPU) and install it into a venv.
#
#   lab/horovod_build.sh [PYTHON]        (default .venv/bin/python; `make horovod` runs it)
#
# Horovod is only needed for the real multi-worker runs that validate predictions, so it is an
# optional install, not a dependency. There is no Horovod wheel on PyPI, and its 0.28.1 sdist
# does not build against torch 2.13 as it is:
#   - torch 2.13's headers need C++17, and Horovod sets C++14 in two places (`CMakeLists.txt`,
#     `horovod/torch/CMakeLists.txt`): both become 17;
#   - its bundled Gloo declares an old `cmake_minimum_required`, which CMake 4 refuses: the build
#     uses a CMake 3 (the system's, else pip's `cmake<4` in a temporary folder), with
#     CMAKE_POLICY_VERSION_MINIMUM=3.5 for a CMake 4 that a user forces through HOROVOD_CMAKE.
# The wheel is built once per Python, torch and Horovod version into a cache folder
# (WHATIF_WHEEL_CACHE, default ~/.cache/whatif-wheels) and reused from there: a build takes about
# 5 minutes on two cores (284 s from scratch here).
set -euo pipefail

HOROVOD_VERSION=0.28.1
PYTHON=${1:-.venv/bin/python}
CACHE=${WHATIF_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/whatif-wheels}

say() { echo "horovod_build: $*"; }
die() { echo "horovod_build: error: $*" >&2; exit 1; }

[ -x "$PYTHON" ] || die "no Python at $PYTHON (create the venv first, e.g. make test)"
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
    die "torch is not installed in $PYTHON's environment; Horovod's PyTorch support is built against it (pip install torch==2.13.0)"
python_tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheel_dir="$CACHE/horovod-$HOROVOD_VERSION-torch-$torch_version-$python_tag"

already_installed() {
    "$PYTHON" - "$HOROVOD_VERSION" <<'EOF' 2>/dev/null
import sys
import horovod, horovod.torch
sys.exit(0 if horovod.__version__ == sys.argv[1] and horovod.torch.gloo_built() else 1)
EOF
}

choose_cmake() {
    if [ -n "${HOROVOD_CMAKE:-}" ]; then echo "$HOROVOD_CMAKE"; return; fi
    local candidate major
    for candidate in /usr/bin/cmake "$(command -v cmake || true)"; do
        [ -x "$candidate" ] || continue
        major=$("$candidate" --version | sed -n 's/^cmake version \([0-9]*\).*/\1/p')
        if [ "$major" = 3 ]; then echo "$candidate"; return; fi
    done
    say "no CMake 3 found; installing pip's cmake<4 into $work/cmake" >&2
    "$PYTHON" -m pip install --quiet --target "$work/cmake" 'cmake>=3.18,<4' >&2
    printf '#!/bin/sh\nPYTHONPATH=%s exec %s "$@"\n' "$work/cmake" "$work/cmake/bin/cmake" > "$work/run_cmake"
    chmod +x "$work/run_cmake"
    echo "$work/run_cmake"
}

build_wheel() {
    command -v g++ >/dev/null || die "no C++ compiler (g++); install build-essential"
    command -v make >/dev/null || die "no make; install build-essential"
    say "building Horovod $HOROVOD_VERSION against torch $torch_version ($python_tag) in $work"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    local src="$work/horovod-$HOROVOD_VERSION" file
    for file in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        grep -q 'set(CMAKE_CXX_STANDARD 14)' "$src/$file" || die "$file has no 'set(CMAKE_CXX_STANDARD 14)' to patch"
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/$file"
    done
    # What setup.py needs at build time; with --no-build-isolation it must be here already.
    "$PYTHON" -m pip install --quiet setuptools wheel packaging cloudpickle psutil pyyaml 'cffi>=1.4.0'
    local cmake_bin
    cmake_bin=$(choose_cmake)
    say "using $cmake_bin ($("$cmake_bin" --version | head -1)), make -j$(nproc)"
    mkdir -p "$work/wheel"
    HOROVOD_CMAKE="$cmake_bin" CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        "$PYTHON" -m pip wheel --verbose --no-deps --no-build-isolation -w "$work/wheel" "$src"
    mkdir -p "$wheel_dir"
    mv "$work"/wheel/horovod-*.whl "$wheel_dir/"
    say "cached $(ls "$wheel_dir"/horovod-*.whl)"
}

if already_installed; then
    say "Horovod $HOROVOD_VERSION with Gloo is already installed for $PYTHON"
    exit 0
fi
if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    work=$(mktemp -d -t whatif-horovod.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    start=$(date +%s)
    build_wheel
    say "built in $(( $(date +%s) - start )) s"
fi
"$PYTHON" -m pip install --quiet --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl
"$PYTHON" -m pip install --quiet cloudpickle psutil pyyaml packaging 'cffi>=1.4.0'
already_installed || die "Horovod installed but horovod.torch does not import with Gloo built in"
say "installed $(basename "$wheel_dir"/horovod-*.whl) into $PYTHON's environment"
