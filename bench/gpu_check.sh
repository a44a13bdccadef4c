#!/usr/bin/env bash
# The device check on the lent GPU machine, from the working tree (bench/README.md).
#
#   bash bench/gpu_check.sh OUT_DIR [gpu_check.py options...]
#
# That machine has Python 3.12, CuPy, onnx, onnxruntime and NumPy, no Ray and no registry:
# Ray comes from the slim wheels in .whl/ (../shared/device/ray_wheels.sh .whl, sent along
# with the command), installed to $SITE (default /tmp/site); the project runs from PYTHONPATH.
set -uo pipefail
out=${1:?usage: bench/gpu_check.sh OUT_DIR [options]}
shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
site=${SITE:-/tmp/site}
t0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
        > "$out/pip.txt" 2>&1 || echo "slim Ray wheels did not install (see pip.txt); the Ray part will report it"
fi
echo "wheels installed in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH} RAY_AUTH_MODE=disabled
python3 bench/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
