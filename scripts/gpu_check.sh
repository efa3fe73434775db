#!/usr/bin/env bash
# Runs every test of ringserve's CUDA paths on this machine's GPU: the compiled triton attention
# kernels against a reference, the ModelRunner end to end on CUDA (fp32 against transformers,
# bf16 triton and flashinfer against the torch backend), then flashinfer's backend alone (last:
# flashinfer compiles its kernels with nvcc on first use, which takes minutes).
#
#   scripts/gpu_check.sh [pytest args...]      PYTHON=... to pick the interpreter (default python3)
#
# Fails when torch sees no CUDA device (the tests would all skip). flashinfer is optional: its
# tests skip, with the reason printed, when it is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the repo importable without an install (the triton check runs its file in a child process)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# flashinfer's JIT builds with ninja: one nvcc per core
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

if ! "$PY" - <<'EOF'
import importlib.util
import torch
import triton
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: torch sees no CUDA device; nothing to check here")
fi = importlib.util.find_spec("flashinfer")
fi_version = __import__("flashinfer").__version__ if fi else "not installed"
print(f"gpu_check: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
      f"torch {torch.__version__}, triton {triton.__version__}, flashinfer {fi_version}")
EOF
then
    exit 2
fi

# From test_triton_attention.py only its CUDA test (the compiled kernels, in a child process): the
# others run the kernels in triton's interpreter on the CPU, which the CPU suite covers. On the
# H200 (triton 3.6, numpy 2.5) the interpreted kernels failed (that interpreter takes int() of
# one-element arrays, which numpy 2.5 refuses; triton 3.9 squeezes them first), and kernels
# compiled afterwards in the same process then failed to build.
"$PY" -m pytest -x -q -rs tests/server/test_triton_attention.py::test_compiled_kernels_on_cuda \
    tests/gpu/test_gpu_cuda.py tests/gpu/test_gpu_flashinfer.py "$@"
status=$?
if [ "$status" -eq 0 ]; then
    echo "gpu_check: PASSED (skips, if any, are listed above)"
else
    echo "gpu_check: FAILED (pytest exit status $status)"
fi
exit "$status"
