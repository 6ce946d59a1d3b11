#!/usr/bin/env bash
# One GPU session, start to finish, in at most 8 minutes of wall time (a device command is capped at 10).
#
#   benchmarks/gpu_session.sh [--dry-run] [--out DIR] [--machine NAME] [--commit HASH] [--budget SECONDS]
#
# On a machine with one NVIDIA GPU, from the repository root (no network needed):
#   1. env      record nvidia-smi, python, torch/jax/onnxruntime versions
#   2. install  the wheels of .whl/ (benchmarks/gpu_wheels.sh fetched them: asv and its needs) into a --target
#               folder on PYTHONPATH, then mha-harness itself (editable; else a plain install into that folder)
#   3. list     mha-harness list -v (why each backend is or is not available)
#   4. check    mha-harness check on every available CUDA/GPU backend (isolated workers, per-case timeout)
#   5. prefill  `mha-harness bench --dtype bfloat16`, Tq = Tk up to 65,536: torch backends, then JAX backends
#               (separate runs), then a causal sweep of the kernels whose causal flag needs no materialised mask
#   6. decode   `mha-harness bench --workload decode`: Tq = 1 and 16 against KV lengths up to 65,536,
#               bottom-right causal
#   7. asv      asv run under machine NAME (default h200-gpu), results in DIR/asv/NAME/ (copied to
#               results/asv/NAME/ on a real run)
#   8. pack     DIR/summary.tsv (step, exit code, seconds, status, note); when $OUT is set (the device tool's
#               output folder), DIR (and results/asv/NAME) in $OUT/gpu_results.tar.gz, paths relative to the
#               repository root, plus $OUT/gpu_summary.tsv and $OUT/gpu_session.log beside it
# Every step runs under its own `timeout` (SIGTERM, then SIGKILL 10 s later), clipped to an overall deadline
# (--budget, default 480 s, minus a reserve for packing); a failed or timed-out step is logged and the
# session goes on. Exit status: 0 when every step that ran succeeded, 1 otherwise.
#
# --dry-run (CPU, for the test suite): the same steps with tiny sizes. GPU backends are resolved by name
# (and each one is confirmed to be refused cleanly by `check`), the GPU steps run on CPU stand-ins
# (torch-sdpa-math-cpu, torch-eager, jax-explicit), the wheels are validated with `pip install --dry-run`
# for Python 3.12 rather than installed, mha-harness is used as installed, and nothing is copied into results/.
# --steps A,B,...: run only these steps (names as in summary.tsv; the others are recorded as not selected).
# --commit HASH: the asv results are recorded against HASH. Without a .git folder (the device tool sends
# the working tree only) asv records against a throwaway repository's commit, which is then renamed to HASH;
# pass the lead's `git rev-parse HEAD` so `asv publish` here finds the commit.
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"

DRY=0
OUTDIR=results/gpu
MACHINE=h200-gpu
COMMIT=""
BUDGET=480
STEPS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) OUTDIR="$2"; shift ;;
        --machine) MACHINE="$2"; shift ;;
        --commit) COMMIT="$2"; shift ;;
        --budget) BUDGET="$2"; shift ;;
        --steps) STEPS=",$2," ; shift ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        *) echo "gpu_session.sh: unknown argument $1 (accepted: --dry-run, --out DIR, --machine NAME," \
                "--commit HASH, --budget SECONDS, --steps A,B)" >&2; exit 2 ;;
    esac
    shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_session.sh: --budget: got '$BUDGET'; accepted: whole seconds" >&2; exit 2 ;; esac

PY="${PYTHON:-python3}"
export DRY MACHINE COMMIT BUDGET REPO PY
START=$(date +%s)
DEADLINE=$((START + BUDGET))
RESERVE=25                       # seconds kept for packing
mkdir -p "$OUTDIR/logs" || { echo "gpu_session.sh: --out: cannot create $OUTDIR" >&2; exit 2; }
OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="$(mktemp -d /tmp/gpu_session.XXXXXX)"
export OUTDIR WORK
SUMMARY="$OUTDIR/summary.tsv"
LOG="$OUTDIR/session.log"
printf 'step\texit\tseconds\tstatus\tnote\n' >"$SUMMARY"
: >"$LOG"
FAILED=0
STEP_NO=0

export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX would otherwise take 75% of the GPU in every process
export TF_CPP_MIN_LOG_LEVEL=2
export MHA_HARNESS_JAX_CACHE="$WORK/jax-cache"
export MPLBACKEND=Agg
export TQDM_DISABLE=1                        # plain logs, no progress bars

say() { echo "[gpu_session $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
selected() { [ -z "$STEPS" ] || [ "${STEPS#*,"$1",}" != "$STEPS" ]; }  # chosen by --steps (or no --steps)
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$SUMMARY"; }

# step NAME LIMIT_SECONDS COMMAND...: run under timeout (clipped to the deadline), log to logs/NN-NAME.log
step() {
    local name="$1" limit="$2"; shift 2
    STEP_NO=$((STEP_NO + 1))
    local logfile="$OUTDIR/logs/$(printf '%02d' "$STEP_NO")-$name.log"
    if ! selected "$name"; then
        record "$name" - 0 skipped "not selected (--steps)"
        return 0
    fi
    [ "$DRY" = 1 ] && limit=$((limit * 3))  # a CPU box of few cores is slower at every step than the GPU machine
    local left=$((DEADLINE - RESERVE - $(date +%s)))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 5 ]; then
        say "SKIP $name: no time left before the deadline"
        record "$name" - 0 skipped "no time left before the ${BUDGET}s deadline"
        return 0
    fi
    say "START $name (timeout ${limit}s): $*"
    local t0 rc status
    t0=$(date +%s)
    if declare -F "$1" >/dev/null; then  # a function of this script: run it in a bash that timeout can kill
        timeout -k 10 "$limit" bash -c "$(declare -f "$1"); \"\$@\"" _ "$@" >"$logfile" 2>&1
    else
        timeout -k 10 "$limit" "$@" >"$logfile" 2>&1
    fi
    rc=$?
    local secs=$(($(date +%s) - t0))
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    [ $rc -ne 0 ] && FAILED=1
    tail -n 15 "$logfile" | sed 's/^/    /' >>"$LOG"
    say "END $name: exit $rc, ${secs}s, $status"
    record "$name" "$rc" "$secs" "$status" "log: logs/$(basename "$logfile")"
}

note() { say "NOTE $1: $2"; record "$1" - 0 note "$2"; }

csv() { paste -sd, -; }
backend_args() { for n in "$@"; do printf -- '--backend %s ' "$n"; done; }

MH=("$PY" -m mha_harness)
BACKENDS=("$PY" benchmarks/gpu_backends.py)

# ---------------------------------------------------------------- 1. env
env_report() {
    date -u
    echo "dry-run: $DRY  machine: $MACHINE  budget: ${BUDGET}s  out: $OUTDIR"
    uname -a
    nproc
    command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
    "$PY" - <<'PYEOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "torch", "jax", "jaxlib", "flax", "onnxruntime", "onnx", "asv", "tqdm", "matplotlib"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
try:
    import torch
    print("torch.cuda.is_available:", torch.cuda.is_available(),
          torch.cuda.get_device_name() if torch.cuda.is_available() else "")
except Exception as exc:  # noqa: BLE001
    print("torch cuda probe failed:", exc)
try:
    import jax
    print("jax devices:", jax.devices())
except Exception as exc:  # noqa: BLE001
    print("jax devices failed:", exc)
PYEOF
}
step env 60 env_report

# ---------------------------------------------------------------- 2. install
export SITE="$WORK/site"
install_wheels() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no wheels in .whl/ (run benchmarks/gpu_wheels.sh where pip reaches the registry)"
        [ "$DRY" = 1 ] && { echo "dry-run: nothing to validate"; return 0; }
        return 1
    fi
    printf '%s\n' "${wheels[@]}"
    if [ "$DRY" = 1 ]; then  # validate the set for the GPU machine's Python without installing it here
        "$PY" -m pip install --dry-run -q --no-index --no-deps --only-binary=:all: --target "$SITE" \
            --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${wheels[@]}"
        return
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}
step install-wheels 90 install_wheels
[ "$DRY" = 1 ] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

install_self() {
    if [ "$DRY" = 1 ]; then
        echo "dry-run: mha-harness used as installed: $("$PY" -c 'import mha_harness; print(mha_harness.__file__)')"
        return
    fi
    if "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e .; then
        echo "editable install done"
    else
        echo "editable install failed; installing into $SITE instead"
        "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" --upgrade . || return 1
    fi
    "$PY" -c 'import mha_harness, mha_harness.implementations; print("mha_harness from", mha_harness.__file__)'
}
step install-self 90 install_self

# ---------------------------------------------------------------- 3. list
step list 60 "${MH[@]}" list -v
cp "$OUTDIR/logs/$(printf '%02d' "$STEP_NO")-list.log" "$OUTDIR/list.txt" 2>/dev/null

# which backends: every registered GPU backend; the available ones, per framework, for the GPU steps
NEED_NAMES=0
for s in gpu-names-refused check prefill-torch prefill-jax prefill-causal decode asv; do selected $s && NEED_NAMES=1; done
: >"$WORK/names.tsv"
[ $NEED_NAMES = 1 ] && "${BACKENDS[@]}" --device gpu --table >"$WORK/names.tsv" 2>"$OUTDIR/logs/names.log"
cp "$WORK/names.tsv" "$OUTDIR/gpu_backends.tsv" 2>/dev/null
pick() { awk -F'\t' -v fw="$1" -v av="$2" '(fw == "" || $2 == fw) && (av == "" || $3 == av) {print $1}' "$WORK/names.tsv"; }
mapfile -t GPU_ALL < <(pick "" "")
mapfile -t GPU_TORCH < <(pick torch yes)
mapfile -t GPU_JAX < <(pick jax yes)
mapfile -t GPU_OTHER < <(pick other yes)
say "GPU backends registered: ${GPU_ALL[*]:-none}"
say "available: torch: ${GPU_TORCH[*]:-none}; jax: ${GPU_JAX[*]:-none}; other: ${GPU_OTHER[*]:-none}"
if [ $NEED_NAMES = 1 ] && [ ${#GPU_ALL[@]} -eq 0 ]; then note backends "no GPU backend is registered (registry import failed?)"; FAILED=1; fi

if [ "$DRY" = 1 ]; then
    # every GPU name must be known to the CLI and refused cleanly here (exit 2, "not available here")
    refused_cleanly() {  # one process: `mha-harness check --backend NAME` for each, each must exit 2
        "$PY" - "$WORK/refused" "$@" <<'PYEOF'
import contextlib, io, sys
from mha_harness.cli import main
bad = 0
for name in sys.argv[2:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["check", "--backend", name, "--results", sys.argv[1]])
    ok = rc == 2 and "not available here" in err.getvalue()
    bad |= not ok
    print(f"{'ok' if ok else 'UNEXPECTED'} (exit {rc}): {err.getvalue().strip()[:200]}")
sys.exit(bad)
PYEOF
    }
    if [ ${#GPU_TORCH[@]} -eq 0 ] && [ ${#GPU_JAX[@]} -eq 0 ]; then step gpu-names-refused 120 refused_cleanly "${GPU_ALL[@]}"; fi
    # CPU stand-ins for the GPU steps, tiny sizes
    [ ${#GPU_TORCH[@]} -eq 0 ] && GPU_TORCH=(torch-sdpa-math-cpu torch-eager)
    [ ${#GPU_JAX[@]} -eq 0 ] && GPU_JAX=(jax-explicit)
    CAUSAL_SET=(torch-sdpa-math-cpu)
    DTYPE=float32
    PREFILL_LENS=512,1024  # memory above the RSS method's resolution, or the memory plot has nothing to draw
    KV_LENS=64
    Q_LENS=1,4
    BENCH=(--threads 2 --budget 0.2 --bench-timeout 120)
    CHECK_ARGS=(--case check_scores_scaled_by_sqrt_d_head --case check_causal_mask_blocks_future_keys --quick)
    ASV_BACKENDS=torch-sdpa-math-cpu
    ASV_LENS=32
    ASV_KV_LENS=64
    ASV_BENCH='TimeForward\.time_forward|Decode\.time_decode'
else
    # causal prefill only where the backend's own causal flag needs no T x T mask built on the host
    CAUSAL_SET=()
    for n in "${GPU_TORCH[@]}" "${GPU_JAX[@]}"; do
        case "$n" in torch-sdpa-flash-*|torch-sdpa-efficient-*|torch-sdpa-cudnn-*|jax-dpa-*|torch-flex-*) CAUSAL_SET+=("$n") ;; esac
    done
    DTYPE=bfloat16
    PREFILL_LENS=1024,4096,16384,65536
    KV_LENS=4096,16384,65536
    Q_LENS=1,16
    BENCH=(--threads 8 --budget 0.5 --bench-timeout 45)  # GPU timings settle fast; a stuck kernel costs 45 s
    CHECK_ARGS=()
    # asv starts one process per parameter combination (torch/JAX import and CUDA start each time): keep it small;
    # memory and GFLOP/s of the same shapes come from the prefill sweep
    ASV_BACKENDS=$(printf '%s\n' "${GPU_TORCH[@]}" "${GPU_JAX[@]}" | grep -E 'sdpa-flash|jax-dpa-cudnn' | csv)
    ASV_LENS=16384,65536
    ASV_KV_LENS=65536
    ASV_BENCH='TimeForward\.time_forward|Decode\.time_decode'
fi
CHECK_SET=("${GPU_TORCH[@]}" "${GPU_JAX[@]}" "${GPU_OTHER[@]}")
JOBS=${#CHECK_SET[@]}   # one isolated worker per backend at once (16 cores; JAX does not preallocate)
[ "$JOBS" -gt 12 ] && JOBS=12
[ "$DRY" = 1 ] && JOBS=2

if [ $NEED_NAMES = 1 ] && [ ${#CHECK_SET[@]} -eq 0 ]; then  # without a backend, `check` and `bench` would take every CPU backend instead
    note gpu "no GPU backend is available (see list.txt and logs/names.log): the GPU steps are skipped"
    STEPS=",none,"
    FAILED=1
fi

# ---------------------------------------------------------------- 4. check
step check 110 "${MH[@]}" check $(backend_args "${CHECK_SET[@]}") "${CHECK_ARGS[@]}" --timeout 60 --jobs "$JOBS" \
    --results "$OUTDIR"

# ---------------------------------------------------------------- 5. prefill
step prefill-torch 90 "${MH[@]}" bench $(backend_args "${GPU_TORCH[@]}") --seq-lens "$PREFILL_LENS" \
    --dtype "$DTYPE" "${BENCH[@]}" --results "$OUTDIR/prefill-torch"
step prefill-jax 50 "${MH[@]}" bench $(backend_args "${GPU_JAX[@]}") --seq-lens "$PREFILL_LENS" \
    --dtype "$DTYPE" "${BENCH[@]}" --results "$OUTDIR/prefill-jax"
if [ ${#CAUSAL_SET[@]} -gt 0 ]; then
    step prefill-causal 35 "${MH[@]}" bench $(backend_args "${CAUSAL_SET[@]}") --seq-lens "$PREFILL_LENS" \
        --causal on --dtype "$DTYPE" "${BENCH[@]}" --results "$OUTDIR/prefill-causal"
else
    note prefill-causal "no available backend with a mask-free causal flag"
fi

# ---------------------------------------------------------------- 6. decode
step decode 50 "${MH[@]}" bench --workload decode $(backend_args "${GPU_TORCH[@]}" "${GPU_JAX[@]}") \
    --seq-lens "$KV_LENS" --query-lens "$Q_LENS" --dtype "$DTYPE" "${BENCH[@]}" --results "$OUTDIR/decode"

# ---------------------------------------------------------------- 7. asv
export ASV_HOME="$WORK/asv-home" ASV_CONF="$WORK/asv.conf.json" ASV_BACKENDS ASV_LENS ASV_KV_LENS ASV_BENCH
asv_session() {
    mkdir -p "$ASV_HOME"
    local repo="$REPO" hash
    hash=$(git -C "$REPO" rev-parse HEAD 2>/dev/null)
    [ "$DRY" = 1 ] && hash=""  # the dry run takes the device's path: its working tree comes without .git
    if [ -z "$hash" ]; then
        command -v git >/dev/null || { echo "asv needs git and there is no git here: asv skipped"; return 3; }
        repo="$WORK/asv-repo"  # the working tree came without .git: a throwaway repository gives asv a commit
        git init -q "$repo" && git -C "$repo" symbolic-ref HEAD refs/heads/main && git -C "$repo" -c user.name=gpu-session -c user.email=gpu@invalid \
            commit -q --allow-empty -m "gpu session of ${COMMIT:-an unknown commit}" || return 3
        hash=$(git -C "$repo" rev-parse HEAD)
        echo "no .git in the checkout: throwaway commit $hash (renamed to ${COMMIT:-<not given>} afterwards)"
    fi
    "$PY" - "$REPO/asv.conf.json" "$ASV_CONF" "$repo" "$REPO/benchmarks" "$OUTDIR/asv" "$OUTDIR/asv-html" <<'PYEOF'
import json, re, sys
src, dst, repo, bench, results, html = sys.argv[1:]
conf = json.loads(re.sub(r"^\s*//.*$", "", open(src).read(), flags=re.M))
conf.update(repo=repo, benchmark_dir=bench, results_dir=results, html_dir=html, default_benchmark_timeout=120)
json.dump(conf, open(dst, "w"), indent=2)
PYEOF
    HOME="$ASV_HOME" "$PY" -m asv machine --yes --config "$ASV_CONF" --machine "$MACHINE" --os "$(uname -sr)" \
        --arch "$(uname -m)" --num_cpu "$(nproc)" --ram "$(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)" \
        --cpu "$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) || true) / $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)" \
        || return 1
    HOME="$ASV_HOME" MHA_ASV_BACKENDS="$ASV_BACKENDS" MHA_ASV_SEQ_LENS="$ASV_LENS" MHA_ASV_DECODE_KV_LENS="$ASV_KV_LENS" \
        "$PY" -m asv run --config "$ASV_CONF" --python=same --quick --show-stderr --set-commit-hash "$hash" -b "$ASV_BENCH" \
        --machine "$MACHINE" || return 1
    if [ -n "$COMMIT" ] && [ "$COMMIT" != "$hash" ]; then
        "$PY" - "$OUTDIR/asv/$MACHINE" "$hash" "$COMMIT" <<'PYEOF'
import json, os, sys
folder, old, new = sys.argv[1:]
for name in os.listdir(folder):
    if name.startswith(old[:8]) and name.endswith(".json"):
        doc = json.load(open(os.path.join(folder, name)))
        doc["commit_hash"] = new
        json.dump(doc, open(os.path.join(folder, new[:8] + name[8:]), "w"))
        os.remove(os.path.join(folder, name))
        print(f"asv result {name} recorded against {new}")
PYEOF
    fi
    ls -l "$OUTDIR/asv/$MACHINE"
}
if [ -z "$ASV_BACKENDS" ]; then
    note asv "no available backend for the asv recording"
elif "$PY" -c "import asv" 2>/dev/null; then
    step asv 75 asv_session
    if [ "$DRY" = 0 ] && [ -d "$OUTDIR/asv/$MACHINE" ]; then
        mkdir -p results/asv && rm -rf "results/asv/$MACHINE" && cp -r "$OUTDIR/asv/$MACHINE" "results/asv/$MACHINE"
    fi
else
    note asv "asv is not importable (were the .whl wheels carried?): asv skipped"
    FAILED=1
fi

# ---------------------------------------------------------------- 8. pack
TOTAL=$(($(date +%s) - START))
record total "$FAILED" "$TOTAL" "$([ $FAILED = 0 ] && echo ok || echo 'some steps failed')" "budget ${BUDGET}s"
say "done in ${TOTAL}s; summary: $SUMMARY"
column -t -s $'\t' "$SUMMARY" 2>/dev/null | tee -a "$LOG" || cat "$SUMMARY"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$SUMMARY" "$OUT/gpu_summary.tsv"
    cp "$LOG" "$OUT/gpu_session.log"
    # paths relative to the repository root when DIR is under it (unpack there with tar xzf), else to DIR's parent
    if [ "${OUTDIR#"$REPO"/}" != "$OUTDIR" ]; then
        members=("${OUTDIR#"$REPO"/}")
        if [ "$DRY" = 0 ] && [ -d "results/asv/$MACHINE" ]; then members+=("results/asv/$MACHINE"); fi
        tar czf "$OUT/gpu_results.tar.gz" -C "$REPO" "${members[@]}"
    else
        tar czf "$OUT/gpu_results.tar.gz" -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")"
    fi
    ls -l "$OUT" | tee -a "$LOG"
fi
rm -rf "$WORK"
exit $FAILED
