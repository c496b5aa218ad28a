#!/usr/bin/env bash
# GPU check (issue 7), one command, under 5 minutes, from a fresh copy of the repository:
#
#   bash benchmarks/gpu_check.sh            # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --cpu      # the same steps on CPU (a smoke run of this script)
#
# 1. the device-feed tests, CUDA ones included (a CUDA test that is skipped fails the check);
# 2. benchmarks/multigpu.py on 1 GPU at 50 ms (stress) and 200 ms (realistic) steps, with the plain
#    pinned copy_ of the same bytes for the H2D comparison;
# 3. one table of both runs and the PASS/MISS checks (stall < 1% at 200 ms, H2D >= 80% of copy_).
#
# Python: .venv/bin/python when its torch sees CUDA (what `make venv` builds), else $PYTHON or python3
# with a CUDA torch already installed: this script never installs torch. Missing small dependencies
# (webdataset, braceexpand, PyYAML, tqdm, pytest) are installed with pip, from ./.whl/ when that
# folder exists (a machine without network), else from the index. mixer itself is imported from this
# checkout (PYTHONPATH), so nothing needs building.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DEVICE=cuda
if [[ "${1:-}" == "--cpu" ]]; then DEVICE=cpu; fi

has_torch() {  # $1: python; true when it imports torch (and, for cuda, sees a GPU)
    "$1" - "$DEVICE" <<'EOF' >/dev/null 2>&1
import sys, torch
sys.exit(0 if sys.argv[1] == "cpu" or torch.cuda.is_available() else 1)
EOF
}

PY=""
for candidate in "$ROOT/.venv/bin/python" "${PYTHON:-}" python3 python; do
    [[ -n "$candidate" ]] || continue
    command -v "$candidate" >/dev/null 2>&1 || [[ -x "$candidate" ]] || continue
    if has_torch "$candidate"; then PY=$candidate; break; fi
done
if [[ -z "$PY" ]]; then
    echo "gpu_check: no python with a torch that sees CUDA (tried .venv, \$PYTHON, python3, python)" >&2
    exit 2
fi

NEED=()
for pair in webdataset:webdataset braceexpand:braceexpand yaml:PyYAML tqdm:tqdm numpy:numpy pytest:pytest pytest_timeout:pytest-timeout; do
    "$PY" -c "import ${pair%%:*}" >/dev/null 2>&1 || NEED+=("${pair##*:}")
done
if (( ${#NEED[@]} )); then
    echo "gpu_check: installing ${NEED[*]} into $("$PY" -c 'import sys; print(sys.prefix)')"
    if [[ -d "$ROOT/.whl" ]]; then
        "$PY" -m pip install -q --no-index --find-links "$ROOT/.whl" "${NEED[@]}"
    else
        "$PY" -m pip install -q "${NEED[@]}"
    fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPUs: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
EOF

OUT="$ROOT/.bench/gpu_check"
mkdir -p "$OUT"
START=$SECONDS

echo "== 1/3 device-feed tests"
set +e
"$PY" -m pytest -q -rs -p no:cacheprovider tests/runtime/test_device.py 2>&1 | tee "$OUT/pytest.txt"
status=${PIPESTATUS[0]}
set -e
if (( status != 0 )); then echo "gpu_check: device tests FAILED" >&2; exit 1; fi
if [[ "$DEVICE" == cuda ]] && grep -q "needs CUDA" "$OUT/pytest.txt"; then
    echo "gpu_check: CUDA tests were skipped although this is the GPU check" >&2
    exit 1
fi

echo "== 2/3 multigpu.py, 1 GPU, 50 ms and 200 ms steps"
if [[ "$DEVICE" == cuda ]]; then
    RUNS=("50 300" "200 100")   # step ms, measured steps: ~15 s and ~20 s of stepping
    EXTRA=(--copy-baseline --workers 2)
else
    RUNS=("50 20" "200 5")
    EXTRA=(--workers 1)
fi
JSONS=()
for run in "${RUNS[@]}"; do
    read -r ms steps <<<"$run"
    json="$OUT/multigpu-$DEVICE-1x-${ms}ms.json"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/multigpu.py \
        --device "$DEVICE" --config demo --cache-dir "$OUT/demo" --steps "$steps" --step-ms "$ms" \
        "${EXTRA[@]}" --json "$json"
    JSONS+=("$json")
done

echo "== 3/3 summary ($((SECONDS - START)) s)"
"$PY" benchmarks/multigpu.py --summarize "${JSONS[@]}" | tee "$OUT/summary.md"
echo "gpu_check: results in $OUT"
