#!/usr/bin/env bash
# Every GPU check of this repository in one command, on the python3 that already has
# PyTorch (no virtual environment, no pip, no network), bounded in time by its own timeouts:
#
#   1. the environment: GPU, driver, torch/CUDA/cuDNN/NCCL versions, /dev/shm, CPU, memory
#   2. the GPU-marked tests (pytest -m gpu), with a per-test timeout and a junit report
#   3. memory per rank under DDP and FSDP2 (scripts/memory_table.py) at 1 process and at every GPU,
#      at most 90 s on one GPU, 155 s on several
#   4. a benchmark sized to what time is left, rows in order of importance
#
#   make gpu-check                              # writes results/gpu-check/
#   OUT=/somewhere bash scripts/gpu_check.sh    # or there
#   PYTHON=/opt/py/bin/python make gpu-check    # another interpreter
#
# Writes at most 8 plain files, no folders, to $OUT (default results/gpu-check/):
#   environment.txt  gpu_check.log  pytest.xml  memory.md  benchmark.md  benchmark.json  benchmark.png
#   benchmark-logs.tar.gz (each benchmark row's output and metrics, and memory.json)
# Exit status: 0 when every stage passed, 1 when one failed or ran out of time, 2 without CUDA,
# 130 or 143 when Ctrl-C or SIGTERM stopped it: the running test, memory or benchmark stage is
# stopped too and the rest skipped (during step 1, the environment, once that step ends).
#
# Knobs (environment): GPU_CHECK_SECONDS (whole run, default 510 = 8.5 minutes),
# GPU_CHECK_PYTEST_SECONDS (the test stage, default 250), GPU_CHECK_TEST_TIMEOUT (one test,
# default 150), GPU_CHECK_PYTEST_WORKERS (tests at a time with pytest-xdist, default 4, 0 for one
# at a time), GPU_CHECK_PYTEST_ARGS (default: -m gpu tests), GPU_CHECK_MEMORY_ARGS (default:
# --world-sizes 1,N on N GPUs), GPU_CHECK_BENCH_ARGS (default: the rows below, 3 epochs each). GPU_CHECK_REQUIRE_CUDA=0 runs the stages without a GPU
# (the harness's own tests do that).
set -u

PYTHON="${PYTHON:-python3}"
TOTAL="${GPU_CHECK_SECONDS:-510}"
PYTEST_SECONDS="${GPU_CHECK_PYTEST_SECONDS:-250}"  # 32 tests took 180 s on an H200; 3 more since, 2 of them compile
TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT:-150}"
END_SECONDS=25   # kept back at the end for packing the logs and the summary
KILL_GRACE=20    # a stage that ignores its stop signal is killed this much later
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(realpath -m "${OUT:-$ROOT/results/gpu-check}")"
# Most telling first: a row that no longer fits the budget is reported as not run, one that
# the budget ends as cut short; neither fails the stage (a row's own --row-timeout does).
BENCH_ROWS="ddp,ddp-bf16,fast-bf16-cudagraphs,fast-bf16-cudagraphs-ddp,ddp-nchw,ddp-bf16-nchw,ddp-1proc-noddp"
BENCH_ROWS="$BENCH_ROWS,fast-bf16,ceiling-bf16-nchw,ceiling-bf16-channels-last,ceiling-bf16-cudagraphs"
BENCH_ROWS="$BENCH_ROWS,fast-bf16-compile,fsdp2,fsdp2-bf16,ddp-1proc"
# One memory-table launch (torchrun, every strategy at one world size) took 20 s with one process
# on an H200. Two launches, 1 and N processes, not memory_table.py's 1, 2, 4, ..., N: on 8 GPUs those
# four would not fit, and 1 against N shows the whole of what sharding saves.
MEMORY_LAUNCH_SECONDS=65
SECONDS=0
cd "$ROOT" || exit 2

# --- is there a GPU? ---------------------------------------------------------------------
GPUS=1
if [ "${GPU_CHECK_REQUIRE_CUDA:-1}" != 0 ]; then
    # --foreground: the probe stays in this script's process group, which a Ctrl-C or a scheduler's
    # signal reaches (the traps come later); timeout's own group would outlive the script.
    probe="$(timeout --foreground -k 5 120 "$PYTHON" -c \
        'import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())' 2>/dev/null)"
    case "$probe" in
        *" True "[0-9]*) GPUS="${probe##* }" ;;
        *" False "*) echo "gpu_check: $PYTHON has PyTorch ${probe%% *} but sees no CUDA GPU: nothing to check here" >&2
                     exit 2 ;;
        *) echo "gpu_check: $PYTHON cannot import torch (PYTHON=... names another interpreter)" >&2
           exit 2 ;;
    esac
fi

mkdir -p "$OUT" || exit 2
# An earlier run's reports would pass for this run's where a stage does not write its own.
rm -f "$OUT"/{environment.txt,gpu_check.log,pytest.xml,memory.md,benchmark.md,benchmark.json,benchmark.png} \
      "$OUT/benchmark-logs.tar.gz"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
LOG="$OUT/gpu_check.log"
: >"$LOG"
FAILED=()
# `timeout` puts each stage in a process group of its own, which Ctrl-C and a scheduler's SIGTERM
# to our group never reach: the signal is handed on to it (timeout passes it to its group), and
# the stages not yet started are skipped.
STOPPED=0 STAGE_PID=
stop() {
    STOPPED=$1
    [ -n "$STAGE_PID" ] || return
    # A stage's `timeout` ignores SIGINT until it has set its handlers (bash starts background
    # commands so), and it starts its command only after: until then SIGTERM, which ends it.
    local sig="$2" caught
    caught="$(awk '/^SigCgt:/ {print $2}' "/proc/$STAGE_PID/status" 2>/dev/null)"
    [ "$sig" = INT ] && (( (16#${caught:-0} & 2) == 0 )) && sig=TERM
    kill -s "$sig" "$STAGE_PID" 2>/dev/null
}
trap 'stop 130 INT' INT
trap 'stop 143 TERM' TERM

say() {  # to the terminal and the log
    echo "$*" | tee -a "$LOG"
}

left() {  # seconds still free for the next stage, its kill grace included
    echo $((TOTAL - END_SECONDS - KILL_GRACE - SECONDS))
}

# run_stage NAME SECONDS SIGNAL COMMAND...: the command's output goes to the log; on time
# out SIGNAL is sent to it (then SIGKILL KILL_GRACE s later). Sets STAGE_STATUS.
run_stage() {
    local name="$1" seconds="$2" sig="$3"
    shift 3
    local began=$SECONDS out="$WORK/$name.out"
    if [ "$STOPPED" -ne 0 ]; then
        say "== $name: not run, stopped by a signal"
        STAGE_STATUS=$STOPPED
        return
    fi
    say "== $name: at most ${seconds} s: $*"
    # In the background: a trap runs during `wait`, not until a foreground command ends.
    timeout -s "$sig" -k "$KILL_GRACE" "$seconds" "$@" >"$out" 2>&1 </dev/null &
    STAGE_PID=$!
    # A signal since the check above found no stage to hand it to. TERM: a `timeout` that has not yet
    # set its handlers still ignores SIGINT, as bash starts background commands, but dies of SIGTERM.
    [ "$STOPPED" -ne 0 ] && kill -s TERM "$STAGE_PID" 2>/dev/null
    while wait "$STAGE_PID"; STAGE_STATUS=$?; kill -0 "$STAGE_PID" 2>/dev/null; do :; done
    STAGE_PID=
    cat "$out" >>"$LOG" 2>/dev/null  # none where the signal came before the stage started
    if [ "$STOPPED" -ne 0 ]; then
        say "== $name: stopped by a signal (status $STAGE_STATUS), $((SECONDS - began)) s"
        FAILED+=("$name (stopped)")
    elif [ "$STAGE_STATUS" -eq 124 ] || [ "$STAGE_STATUS" -eq 137 ]; then
        say "== $name: timed out after ${seconds} s (status $STAGE_STATUS), $((SECONDS - began)) s"
        FAILED+=("$name (timed out)")
    elif [ "$STAGE_STATUS" -ne 0 ]; then
        say "== $name: exit status $STAGE_STATUS, $((SECONDS - began)) s"
        FAILED+=("$name (exit status $STAGE_STATUS)")
    else
        say "== $name: ok, $((SECONDS - began)) s"
    fi
}

# --- 1. the environment --------------------------------------------------------------------
environment() {
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "kernel: $(uname -srm)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //'), $(nproc) logical cores"
    echo "memory: $(free -g 2>/dev/null | awk '/^Mem:/ {print $2 " GiB total, " $7 " GiB available"}')"
    echo "/dev/shm: $(df -h /dev/shm 2>/dev/null | awk 'NR == 2 {print $2 " total, " $4 " free"}')"
    echo "python: $PYTHON = $(command -v "$PYTHON")"
    echo
    echo "--- nvidia-smi"
    timeout -k 5 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap,power.limit,clocks.max.sm \
        --format=csv 2>&1 || echo "(nvidia-smi --query-gpu failed)"
    timeout -k 5 20 nvidia-smi 2>&1 || echo "(nvidia-smi failed)"
    timeout -k 5 20 nvidia-smi topo -m 2>&1 || true
    echo
    echo "--- PyTorch"
    timeout -k 5 90 "$PYTHON" - <<'EOF' 2>&1
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version(),
      "| NCCL", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None)
for name in ("torchvision", "numpy", "pytest", "pytest_timeout", "tqdm", "matplotlib", "triton", "apex"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "(no version)"))
    except Exception as exc:
        print(name, "not importable:", type(exc).__name__)
if torch.cuda.is_available():
    from utils.precision import cuda_bf16_native
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
              f"{p.multi_processor_count} SMs; bf16 native: {cuda_bf16_native(i)}; "
              f"torch.cuda.is_bf16_supported(): {torch.cuda.is_bf16_supported()}")
EOF
}
say "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), budget ${TOTAL} s, writing to $OUT"
environment >"$OUT/environment.txt"
grep -E '^(torch|cuda:)' "$OUT/environment.txt" | tee -a "$LOG"

# --- 2. the GPU tests ----------------------------------------------------------------------
pytest_args=(${GPU_CHECK_PYTEST_ARGS:--m gpu tests})
plugin_args=()
if "$PYTHON" -c 'import pytest_timeout' 2>/dev/null; then
    # Autoloaded unless plugin autoloading is off; then it must be named.
    [ -n "${PYTEST_DISABLE_PLUGIN_AUTOLOAD:-}" ] && plugin_args+=(-p pytest_timeout)
    plugin_args+=(--timeout "$TEST_TIMEOUT")
else
    say "pytest-timeout is not installed: the stage's own timeout is the only bound"
fi
# The GPU tests are mostly process start-up and CUDA initialisation, one after another they
# outlast the stage (first H200 run: 19 of 28 done in 220 s); several at a time on the one GPU
# they fit. Each test measures only its own processes (memory_allocated is per process).
WORKERS="${GPU_CHECK_PYTEST_WORKERS:-4}"
if [ "$WORKERS" != 0 ] && "$PYTHON" -c 'import xdist' 2>/dev/null; then
    [ -n "${PYTEST_DISABLE_PLUGIN_AUTOLOAD:-}" ] && plugin_args+=(-p xdist.plugin)
    plugin_args+=(-n "$WORKERS")
    # pytest-benchmark, where an image has it, warns in every worker that xdist disables it;
    # no test here uses its fixture, so it is left out rather than let ten lines of noise in.
    "$PYTHON" -c 'import pytest_benchmark' 2>/dev/null && plugin_args+=(-p no:benchmark)
fi
stage_seconds=$(( $(left) < PYTEST_SECONDS ? $(left) : PYTEST_SECONDS ))
if [ "$(left)" -lt 30 ]; then  # `timeout 0` would not bound it at all, a negative one is refused
    say "== pytest: not run, $(left) s left"
    FAILED+=("pytest (no time left)")
else
    # SIGINT on time out: pytest then stops like after Ctrl-C and still writes its junit report.
    run_stage pytest "$stage_seconds" INT "$PYTHON" -m pytest -q -p no:cacheprovider "${plugin_args[@]}" \
        --junitxml="$OUT/pytest.xml" -o junit_logging=all -o junit_log_passing_tests=false --durations=15 \
        "${pytest_args[@]}"
    tail -n 25 "$WORK/pytest.out" 2>/dev/null
fi

# --- 3. memory per rank ------------------------------------------------------------------
if [ "$GPUS" -gt 1 ]; then
    memory_args=(${GPU_CHECK_MEMORY_ARGS:---world-sizes 1,$GPUS})
    memory_seconds=$((25 + 2 * MEMORY_LAUNCH_SECONDS))
else
    memory_args=(${GPU_CHECK_MEMORY_ARGS:-})
    memory_seconds=$((25 + MEMORY_LAUNCH_SECONDS))
fi
memory_seconds=$(( $(left) < memory_seconds ? $(left) : memory_seconds ))
if [ "$memory_seconds" -lt 45 ]; then
    say "== memory: not run, ${memory_seconds} s left"
    FAILED+=("memory (no time left)")
else
    mkdir -p "$WORK/benchmark-logs"
    # memory.md beside the other reports; its json travels in the logs' archive (8 files at most).
    run_stage memory "$memory_seconds" TERM "$PYTHON" scripts/memory_table.py "${memory_args[@]}" \
        --row-timeout "$MEMORY_LAUNCH_SECONDS" --out "$WORK/benchmark-logs" --log-dir "$WORK/benchmark-logs"
    [ -f "$WORK/benchmark-logs/memory.md" ] && cp "$WORK/benchmark-logs/memory.md" "$OUT/memory.md"
    sed -n '/^| strategy/,/^$/p' "$WORK/memory.out" 2>/dev/null
fi

# --- 4. the benchmark ----------------------------------------------------------------------
bench_seconds=$(left)
if [ "$bench_seconds" -lt 60 ]; then
    say "== benchmark: not run, ${bench_seconds} s left"
    FAILED+=("benchmark (no time left)")
else
    bench_args=(${GPU_CHECK_BENCH_ARGS:---rows $BENCH_ROWS --epochs 3 --row-timeout 180})
    # The benchmark keeps to --time-budget by itself (rows that do not fit are reported as not
    # run, a row it ends as cut short); SIGTERM after it ends the running row and writes what
    # was measured.
    run_stage benchmark "$bench_seconds" TERM "$PYTHON" scripts/benchmark.py "${bench_args[@]}" \
        --time-budget $((bench_seconds - 10)) --out "$OUT" --log-dir "$WORK/benchmark-logs"
    sed -n '/^| row /,$p' "$WORK/benchmark.out" 2>/dev/null
fi
if [ -d "$WORK/benchmark-logs" ]; then
    tar -czf "$OUT/benchmark-logs.tar.gz" -C "$WORK" benchmark-logs 2>>"$LOG" || say "could not pack the row logs"
fi

# --- the end -------------------------------------------------------------------------------
# A report cut short mid-write leaves its temporary behind (benchmark.py's names; OUT may hold others' files).
rm -f "$OUT"/benchmark.md.tmp "$OUT"/benchmark.json.tmp "$OUT"/benchmark.png.tmp.png
files=$(find "$OUT" -mindepth 1 | wc -l)
[ "$files" -le 8 ] || say "warning: $files entries in $OUT, more than the 8 expected"
if [ "$STOPPED" -ne 0 ]; then
    say "gpu_check: stopped by a signal after ${SECONDS} s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    exit "$STOPPED"
fi
if [ ${#FAILED[@]} -eq 0 ]; then
    say "gpu_check: every stage passed in ${SECONDS} s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    exit 0
fi
say "gpu_check: ${#FAILED[@]} stage(s) failed in ${SECONDS} s: $(printf '%s; ' "${FAILED[@]}")files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit 1
