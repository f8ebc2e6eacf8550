#!/usr/bin/env bash
# The one device call of 2026-11-29, from the repository's root: make gpu-check (its stages
# bounded by GPU_CHECK_SECONDS), then probe.py (the loader alone, the step profiled); the
# reports to $OUT, 8 files at most: the check's own 6, probe.txt, and extras.tar.gz (the
# chart, the rows' logs, the compiled step's trace).
set -u
export PYTHONUNBUFFERED=1
HERE="$(cd "$(dirname "$0")" && pwd)"
DEST="${OUT:-$HERE/run1}"
WORK="$(mktemp -d)"
mkdir -p "$DEST" "$WORK/extras"
ROWS=ddp,ddp-1proc-noddp,ddp-bf16,ddp-bf16-channels-last,ddp-channels-last,fast-bf16
ROWS=$ROWS,ceiling-bf16-nchw,ceiling-bf16-channels-last,fast-bf16-cudagraphs,ceiling-bf16-cudagraphs
ROWS=$ROWS,fast-bf16-compile,fsdp2-bf16,fsdp2
GPU_CHECK_SECONDS="${CHECK_SECONDS:-485}" GPU_CHECK_PYTEST_SECONDS=200 GPU_CHECK_PYTEST_WORKERS=5 \
    GPU_CHECK_BENCH_ARGS="--rows $ROWS --epochs 3 --row-timeout 150" \
    OUT="$WORK/check" PYTHON="${PYTHON:-python3}" bash scripts/gpu_check.sh
echo "gpu_check exit status $?"
timeout -k 5 "${PROBE_SECONDS:-100}" "${PYTHON:-python3}" "$HERE/probe.py" --out "$WORK/extras" \
    >"$DEST/probe.txt" 2>&1
echo "probe exit status $?" | tee -a "$DEST/probe.txt"
tail -n 80 "$DEST/probe.txt"
for f in environment.txt gpu_check.log pytest.xml memory.md benchmark.md benchmark.json; do
    [ -f "$WORK/check/$f" ] && cp "$WORK/check/$f" "$DEST/"
done
for f in benchmark.png benchmark-logs.tar.gz; do
    [ -f "$WORK/check/$f" ] && cp "$WORK/check/$f" "$WORK/extras/"
done
tar -czf "$DEST/extras.tar.gz" -C "$WORK" extras
ls -la "$DEST"
rm -rf "$WORK"
