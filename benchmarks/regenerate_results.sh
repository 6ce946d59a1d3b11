#!/usr/bin/env bash
# Regenerate every committed CPU result under results/, in order, with the commands the README documents.
#
#   benchmarks/regenerate_results.sh [--results DIR] [--steps a,b,...] [--machine NAME] [--dry-run]
#
#   --results DIR   where to write (default: a new temporary folder, printed at the start); a relative DIR is read
#                   from the folder the script is run in. Only `--results results` from the harness's root writes
#                   into the repository's results/: a normal run never touches it.
#   --steps LIST    a subset, in the order below (default: all)
#   --machine NAME  the asv machine name (default: this host's name, `hostname`; the committed results name theirs:
#                   cpu-2core-avx2-box for this 2-core host, cpu-2core-box for an earlier one)
#   --dry-run       print the commands, run nothing, create nothing (not DIR)
#
# Steps (the README's "What you get" table; minutes are estimates for a quiet 2-core box, each step's real
# wall time is printed and logged to DIR/regenerate.log; measured 2026-12-01 where a figure is given):
#   conformance  mha-harness check --mutants                                          ~2 min  DIR/conformance/
#   bench        mha-harness bench --opt-in --budget 1                                3.8 min  DIR/bench/
#   decode       mha-harness bench --workload decode --budget 1                        11 min  DIR/bench-decode/
#   cross        mha-harness bench --workload cross --budget 1                          ~8 min  DIR/bench-cross/
#   long         mha-harness bench --backend (5 CPU kernels) --seq-lens 1024..8192     12 min  DIR/long/bench/
#   window       mha-harness bench --sliding-window 256 --causal on (4 backends that     12 min  DIR/sliding-window/
#                declare it, T 1024..8192), then --workload decode --sliding-window 4096  (bench/, bench-decode/)
#   fidelity     mha-harness fidelity                                                  17 min  DIR/bench/fidelity.json
#   asv          asv run --quick, time/decode/peak memory (T 256,1024; KV 1024,16384) 28 min  DIR/asv/, DIR/html/
#   search       mha-harness search --mutants --seed 0 --time-budget 60               ~5 min  DIR/search/
# The asv step's lengths are MHA_ASV_SEQ_LENS and MHA_ASV_DECODE_KV_LENS when set in the environment (default
# 256,1024 and 1024,16384); the cross benchmarks (bench_cross.py, not in the default set: ASV_BENCH=Cross) take
# MHA_ASV_CROSS_KV_LENS and MHA_ASV_CROSS_QUERY_LENS from the environment (default 77,1024,4096 and 128,4096);
# ASV_BENCH=all records every asv benchmark, ASV_BENCH=REGEX those asv's -b REGEX matches: a re.search on each
# parameter combination's "file.Class.method(param, ...)", so one benchmark exactly is
# ASV_BENCH='^bench_time\.TimeForward\.time_forward\(' (a '$' never matches; names: docs/benchmarks.md, "asv
# dashboards"); ASV_SAMPLING=repeats replaces asv's one-call smoke mode (--quick, the
# default) by asv's own calibrated samples, one setup per benchmark (the time figures then carry asv's spread);
# ASV_EXTRA_ARGS is added to asv run's arguments (ASV_EXTRA_ARGS=
# --show-stderr prints why a row is n/a); MHA_ASV_BACKENDS, MHA_ASV_BACKEND_SPECS and ASV_PYTHONPATH pass
# through to asv, so, from the plugin's folder (its module in $PWD; /path/to/mha-harness: the harness's clone)
#   ASV_PYTHONPATH=$PWD MHA_ASV_BACKEND_SPECS=my_attention:MyAttention /path/to/mha-harness/benchmarks/regenerate_results.sh \
#       --steps asv --results "$(mktemp -d)"
# benchmarks a plugin into its own asv results and dashboard, leaving the committed results/asv/ alone.
# ASV_REPO=FOLDER (a git repository, the plugin's, with nothing uncommitted outside DIR) files the asv results under
# its HEAD commit instead of the harness's: DIR/asv.conf.json gets "repo" FOLDER and "branches" its branch
# (ASV_BRANCH=NAME for a detached HEAD), so recording each plugin commit into one DIR graphs them and
# `python -m asv compare --config DIR/asv.conf.json --machine NAME HEAD~1 HEAD` compares them; the harness's commit
# goes to DIR/asv/harness-commits.tsv (benchmarks/asv_record.sh --help). Record the same backends and lengths into
# one DIR every time: each asv run rewrites DIR/asv/benchmarks.json with its own parameters, and the graphs draw only
# those.
# Run it on a quiet machine: the timings describe the load they ran under (bench.json records the roofs).
# A failed step is reported and the next one runs; the exit code is 1 when any step failed.
# Not covered: results/asv_dashboard_time_forward.png (a headless-Chromium screenshot of the served dashboard)
# and the GPU results (benchmarks/gpu_session.sh).
set -uo pipefail
caller=$(pwd)  # --results DIR and ASV_REPO are read from the caller's folder (a plugin's, say)
cd "$(dirname "$0")/.."
root=$(pwd)

results=""
steps="conformance,bench,decode,cross,long,window,fidelity,asv,search"
machine="$(hostname)"
dry=0
while [ $# -gt 0 ]; do
    case "$1" in
        --results) results="${2:?--results needs a folder}"; shift 2 ;;
        --steps) steps="${2:?--steps needs a list}"; shift 2 ;;
        --machine) machine="${2:?--machine needs a name}"; shift 2 ;;
        --dry-run) dry=1; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "regenerate_results.sh: unknown argument '$1'; accepted: --results DIR, --steps LIST, --machine NAME, --dry-run" >&2; exit 2 ;;
    esac
done
all="conformance bench decode cross long window fidelity asv search"
for s in ${steps//,/ }; do
    case " $all " in *" $s "*) ;; *) echo "regenerate_results.sh: --steps: got '$s'; accepted: ${all// /, }" >&2; exit 2 ;; esac
done
# how asv samples a time benchmark: ASV_SAMPLING=quick (default) is asv's smoke mode, one call after setup per
# point; ASV_SAMPLING=repeats is asv's own calibration (calls per sample until a sample lasts 10 ms, up to 10
# samples within 20 s after a warm-up), in one process per benchmark (rounds=1: its setup, the dear part, runs once)
asv_sampling() {
    case "${ASV_SAMPLING:-quick}" in
        quick) echo "--quick" ;;
        repeats) echo "-a rounds=1" ;;
    esac
}
if [ -z "$(asv_sampling)" ]; then
    echo "regenerate_results.sh: ASV_SAMPLING: got '${ASV_SAMPLING}'; accepted: quick, repeats" >&2; exit 2
fi
# a dry run creates nothing: not DIR, not the temporary folder it names
if [ -z "$results" ]; then
    if [ "$dry" = 1 ]; then
        results=$(mktemp -u -d "${TMPDIR:-/tmp}/mha-results.XXXXXX")
    else
        results=$(mktemp -d "${TMPDIR:-/tmp}/mha-results.XXXXXX")
    fi
fi
case "$results" in /*) ;; *) results="$caller/$results" ;; esac
if [ -d "$results" ]; then
    results=$(cd "$results" && pwd)
elif [ "$dry" = 1 ]; then
    results=$(realpath -m -s "$results")
else
    mkdir -p "$results" || exit 2
    results=$(cd "$results" && pwd)
fi
# ASV_REPO (the asv step): the results are filed under that git repository's HEAD, a plugin's commit, on its branch;
# checked before any step runs (asv_record.sh --check-repo: a git repository, nothing uncommitted outside DIR)
repo_top="" repo_branch=""
if [ -n "${ASV_REPO:-}" ] && [[ ",$steps," == *",asv,"* ]]; then
    case "$ASV_REPO" in /*) ;; *) ASV_REPO="$caller/$ASV_REPO" ;; esac
    if [ "$results" = "$root/results" ]; then
        echo "regenerate_results.sh: ASV_REPO files results under another repository's commits; accepted with a" \
             "--results folder of its own, not the harness's results/" >&2
        exit 2
    fi
    repo_line=$(ASV_REPO="$ASV_REPO" bash "$root/benchmarks/asv_record.sh" --check-repo "$results") || exit 2
    IFS=$'\t' read -r repo_top repo_branch _ <<<"$repo_line"
    export ASV_REPO="$repo_top"
fi
log="$results/regenerate.log"
[ "$dry" = 1 ] && log=/dev/null
echo "regenerate_results.sh: writing under $results (steps: $steps)" | tee -a "$log"
if [ "$results" = "$root/results" ]; then
    echo "  into the repository's results/: review with git diff before committing" | tee -a "$log"
fi

# asv writes where its config says: the project's asv.conf.json for results/, a copy pointing into DIR otherwise
asv_config="$root/asv.conf.json"
if [ "$results" != "$root/results" ]; then
    asv_config="$results/asv.conf.json"
    # with ASV_REPO: "repo" is that repository and "branches" its branch (with those an earlier config in DIR for the
    # same repository named: asv draws only the commits of the branches its config names). A DIR whose results are
    # filed under another repository's commits (the harness's, or another plugin's) is refused, dry run or not.
    python - "$root" "$results" "$asv_config" "$repo_top" "$repo_branch" "$dry" <<'EOF' || exit 2
import json, os, pathlib, sys
from asv.util import load_json
root, results, out, repo, branch, dry = sys.argv[1:]
text = (pathlib.Path(root) / "asv.conf.json").read_text()
text = text.replace('"results/asv"', json.dumps(f"{results}/asv")).replace('"results/html"', json.dumps(f"{results}/html"))
text = text.replace('"benchmark_dir": "benchmarks"', f'"benchmark_dir": {json.dumps(f"{root}/benchmarks")}')
text = text.replace('"repo": "."', f'"repo": {json.dumps(repo or root)}')
branches = [branch]
if os.path.exists(out):
    earlier = load_json(out, js_comments=True)
    if os.path.realpath(earlier.get("repo", "")) != os.path.realpath(repo or root):
        had = earlier.get("repo", "")
        sys.exit(f"regenerate_results.sh: {results} holds asv results filed under the commits of {had}, not of "
                 f"{repo or root}; accepted: " + ("ASV_REPO unset" if os.path.realpath(had) == os.path.realpath(root)
                 else f"ASV_REPO={had}") + ", or another --results folder (one repository's commits per folder)")
    branches = [b for b in earlier.get("branches", []) if b != branch] + branches
if repo:
    text = text.replace('"branches": ["main"]', f'"branches": {json.dumps(branches)}')
if dry != "1":
    pathlib.Path(out).write_text(text)
EOF
fi

# the asv benchmarks: the dashboard's headline ones; ASV_BENCH=all: every one; ASV_BENCH=REGEX: those asv's -b matches
asv_benchmarks() {
    case "${ASV_BENCH:-}" in
        all) ;;
        "") echo " -b TimeForward.time_forward -b Decode.time_decode -b bench_memory.PeakMemory -b ThreadSettings" ;;
        *) echo " -b ${ASV_BENCH}" ;;
    esac
}

command_of() {
    case "$1" in
        conformance) echo "mha-harness check --mutants --results '$results' &&" \
                          "mha-harness check --backend torch-flex-cpu --backend torch-compile-cpu --timeout 600" \
                          "--results '$results'" ;;
        bench) echo "mha-harness bench --opt-in --budget 1 --results '$results'" ;;
        decode) echo "mha-harness bench --workload decode --budget 1 --results '$results'" ;;
        cross) echo "mha-harness bench --workload cross --budget 1 --results '$results'" ;;
        long) echo "mha-harness bench --backend numpy-naive --backend numpy-tiled --backend torch-sdpa-flash-cpu" \
                   "--backend torch-sdpa-math-cpu --backend jax-dpa --seq-lens 1024,2048,4096,8192" \
                   "--results '$results/long'" ;;
        # the layers with a sliding window: numpy-tiled skips the keys behind each query block's window, the others
        # compute every score and mask them
        window) echo "mha-harness bench --backend numpy-naive --backend numpy-tiled --backend torch-eager" \
                     "--backend jax-dpa --causal on --sliding-window 256 --seq-lens 1024,2048,4096,8192 --budget 1" \
                     "--results '$results/sliding-window' &&" \
                     "mha-harness bench --workload decode --backend numpy-naive --backend numpy-tiled" \
                     "--backend torch-eager --backend jax-dpa --sliding-window 4096 --seq-lens 4096,16384,65536" \
                     "--budget 1 --results '$results/sliding-window'" ;;
        fidelity) echo "mha-harness fidelity --results '$results'" ;;
        # the dashboard's headline benchmarks (time, decode time, peak memory; 28 min on 2 cores): the others add
        # 55 min (each parameter of the two compiled backends compiles in asv's setup); ASV_BENCH=all: all
        asv) echo "MHA_ASV_SEQ_LENS='${MHA_ASV_SEQ_LENS:-256,1024}'" \
                  "MHA_ASV_DECODE_KV_LENS='${MHA_ASV_DECODE_KV_LENS:-1024,16384}'" \
                  "ASV_ARGS='$(asv_sampling)$(asv_benchmarks)${ASV_EXTRA_ARGS:+ $ASV_EXTRA_ARGS}'" \
                  "${repo_top:+ASV_REPO='$repo_top' }${ASV_BRANCH:+ASV_BRANCH='$ASV_BRANCH' }ASV_CONFIG='$asv_config'" \
                  "ASV_HTML_DIR='$results/html' benchmarks/asv_record.sh '$machine'" ;;
        search) echo "mha-harness search --mutants --seed 0 --time-budget 60 --results '$results'" ;;
    esac
}

failed=()
start_all=$SECONDS
for step in $all; do
    case ",$steps," in *",$step,"*) ;; *) continue ;; esac
    cmd=$(command_of "$step")
    echo "== $step: $cmd" | tee -a "$log"
    [ "$dry" = 1 ] && continue
    start=$SECONDS
    bash -c "$cmd" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "== $step: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    # check/search exit 1 for findings (a failing backend, a mutant not found): reported, not a failed step
    if [ "$rc" != 0 ] && ! { [ "$rc" = 1 ] && { [ "$step" = conformance ] || [ "$step" = search ]; }; }; then
        failed+=("$step (exit $rc)")
    fi
done
[ "$dry" = 1 ] && exit 0
echo "regenerate_results.sh: done in $((SECONDS - start_all)) s; results under $results; log $log" | tee -a "$log"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed steps: ${failed[*]}" | tee -a "$log"
    exit 1
fi
