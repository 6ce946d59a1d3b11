#!/usr/bin/env bash
# Record this machine's asv results into results/asv/<machine>/ and publish the dashboard to results/html/.
#
#   benchmarks/asv_record.sh [MACHINE_NAME]      # default: this host's name (a name may not start with '-')
#   benchmarks/asv_record.sh --check-repo        # check ASV_REPO; print its folder, branch and HEAD; record nothing
#   benchmarks/asv_record.sh -h | --help         # this text
#
# Runs offline in the current environment (asv.conf.json: environment_type "existing"); results are saved
# against the current commit (--set-commit-hash). Narrow a run with MHA_ASV_BACKENDS / MHA_ASV_SEQ_LENS,
# e.g. MHA_ASV_SEQ_LENS=128,512,2048 benchmarks/asv_record.sh cpu-box. Results from other machines (a GPU box)
# copied into results/asv/<their machine>/ are merged by the same `asv publish` into one dashboard with a
# machine selector. Preview on this machine only (asv preview listens on every interface):
#   python -m http.server --bind 127.0.0.1 --directory results/html 8080   # http://127.0.0.1:8080
# ASV_CONFIG=PATH uses another asv config (one whose results_dir/html_dir point elsewhere: what
# benchmarks/regenerate_results.sh does for a --results folder other than results/), with ASV_HTML_DIR its html_dir.
# ASV_REPO=FOLDER files the results under another git repository's commit: a plugin's own, so asv's graphs,
# `asv compare` and regressions.json follow the plugin's commits, not the harness's. FOLDER (or a folder in it) must
# be a git repository with a commit and nothing uncommitted (tracked changes or untracked files, bar __pycache__/ and
# *.pyc): the results are filed under its HEAD, on its current branch (ASV_BRANCH=NAME: a branch that contains HEAD,
# needed for a detached HEAD). It needs an ASV_CONFIG whose "repo" is that repository and whose "branches" hold
# that branch: `benchmarks/regenerate_results.sh --steps asv --results DIR` writes one into DIR. The harness's own
# commit is printed and added to <results_dir>/harness-commits.tsv (asv has no field for it that would not start
# a separate graph series).
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

# ASV_REPO -> "folder<TAB>branch<TAB>commit" on stdout, or a refusal naming the variable on stderr (exit 2); the
# folders given after it (the results', the dashboard's) may hold changes: they are outputs, not the code measured
check_repo() {
    local where="$1" top commit branch changes containing folder rel
    local pathspec=(. ':(exclude,glob)**/__pycache__/**' ':(exclude,glob)**/*.pyc')
    if ! top="$(git -C "$where" rev-parse --show-toplevel 2>/dev/null)" || [ -z "$top" ]; then
        echo "asv_record.sh: ASV_REPO: got '$where', which is not a git repository; accepted: the folder of a git" \
             "repository (the plugin's), whose HEAD commit the results are filed under" >&2
        return 2
    fi
    if ! commit="$(git -C "$top" rev-parse -q --verify 'HEAD^{commit}')"; then
        echo "asv_record.sh: ASV_REPO: '$top' has no commit yet; accepted: a git repository with its plugin" \
             "committed (the results are filed under its HEAD commit)" >&2
        return 2
    fi
    for folder in "${@:2}"; do
        rel="$(realpath -m --relative-to="$top" "$folder")"
        case "$rel" in .|..|../*|/*) ;; *) pathspec+=(":(exclude,literal)$rel") ;; esac
    done
    # uncommitted code would be measured and filed under a commit that does not hold it; importing the plugin
    # from the folder (ASV_PYTHONPATH) writes __pycache__/, which does not count
    changes="$(git -C "$top" status --porcelain --untracked-files=all -- "${pathspec[@]}")"
    if [ -n "$changes" ]; then
        echo "asv_record.sh: ASV_REPO: '$top' has uncommitted changes (results are filed under HEAD $commit," \
             "which would not hold the code measured); accepted: a clean working tree: commit them (or add" \
             "files that are not the plugin's, build outputs, to .gitignore), then record:" >&2
        echo "$changes" | head -20 | sed 's/^/    /' >&2
        return 2
    fi
    branch="${ASV_BRANCH:-$(git -C "$top" symbolic-ref --short -q HEAD || true)}"
    containing="$(git -C "$top" for-each-ref --contains "$commit" --format='%(refname:short)' refs/heads/ \
        | paste -sd, - || true)"
    if [ -z "$branch" ]; then
        echo "asv_record.sh: ASV_REPO: '$top' has a detached HEAD ($commit); set ASV_BRANCH to a local branch" \
             "that contains it (asv draws a branch's commits; containing it: ${containing:-none})" >&2
        return 2
    fi
    if ! git -C "$top" merge-base --is-ancestor "$commit" "refs/heads/$branch" 2>/dev/null; then
        echo "asv_record.sh: ASV_BRANCH: got '$branch', not a local branch of '$top' that contains HEAD" \
             "$commit; accepted: one that does (${containing:-none contains it})" >&2
        return 2
    fi
    printf '%s\t%s\t%s\n' "$top" "$branch" "$commit"
}

# ASV_REPO, ASV_CONFIG and ASV_HTML_DIR are read from the caller's folder (ASV_REPO=. from the plugin's)
absolute() { case "$1" in ""|/*) printf '%s' "$1" ;; *) printf '%s/%s' "$(pwd)" "$1" ;; esac; }
ASV_REPO="$(absolute "${ASV_REPO:-}")"
ASV_CONFIG="$(absolute "${ASV_CONFIG:-}")"
ASV_HTML_DIR="$(absolute "${ASV_HTML_DIR:-}")"
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    --check-repo)
        [ -n "$ASV_REPO" ] || { echo "asv_record.sh: --check-repo: ASV_REPO is not set" >&2; exit 2; }
        shift; check_repo "$ASV_REPO" "$@"; exit $? ;;
    -*) echo "asv_record.sh: unknown option '$1'; accepted: benchmarks/asv_record.sh [MACHINE_NAME] (a machine" \
             "name, not starting with '-'), --check-repo, -h or --help" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then
    echo "asv_record.sh: got $# arguments ($*); accepted: benchmarks/asv_record.sh [MACHINE_NAME]" >&2; exit 2
fi
cd "$(dirname "$0")/.."
machine="${1:-$(hostname)}"
config=()
if [ -n "$ASV_CONFIG" ]; then config=(--config "$ASV_CONFIG"); fi
html="${ASV_HTML_DIR:-results/html}"
commit="$(git rev-parse HEAD)"
repo_line=""
if [ -n "$ASV_REPO" ]; then
    if [ -z "$ASV_CONFIG" ]; then
        check_repo "$ASV_REPO" >/dev/null || exit 2
        echo "asv_record.sh: ASV_REPO needs ASV_CONFIG, an asv config of its own whose \"repo\" is that" \
             "repository (the project's asv.conf.json records the harness's commits into the committed" \
             "results/asv/); benchmarks/regenerate_results.sh --steps asv --results DIR writes one" >&2
        exit 2
    fi
    results_dir="$(python -c 'import sys; from asv.config import Config; print(Config.load(sys.argv[1]).results_dir)' \
        "$ASV_CONFIG")"
    repo_line="$(check_repo "$ASV_REPO" "$results_dir" "$html" "$(dirname "$ASV_CONFIG")" "$ASV_CONFIG")" || exit 2
    IFS=$'\t' read -r plugin_repo plugin_branch commit <<<"$repo_line"
    # the config must name that repository and branch: asv resolves the commit in its "repo", and draws only the
    # commits of its "branches"
    python - "$ASV_CONFIG" "$plugin_repo" "$plugin_branch" <<'EOF' || exit 2
import os, sys
from asv.config import Config
conf = Config.load(sys.argv[1])
if os.path.realpath(conf.repo) != os.path.realpath(sys.argv[2]) or sys.argv[3] not in conf.branches:
    sys.exit(f"asv_record.sh: ASV_REPO: the asv config {sys.argv[1]} has \"repo\": {conf.repo!r} and \"branches\": "
             f"{conf.branches}; accepted: \"repo\" {sys.argv[2]!r} with {sys.argv[3]!r} among its \"branches\" "
             "(benchmarks/regenerate_results.sh --steps asv --results DIR writes such a config into DIR)")
EOF
fi
# A named machine keeps the RAM it was first recorded with: the kernel's MemTotal drifts by tens of kB between
# boots of the same VM, and asv files results under every machine field, so a new figure would start a separate
# series in the dashboard for the same machine. A machine not yet in ~/.asv-machine.json gets an entry holding its
# name first: `asv machine` (0.6.6) passes on only the fields that differ from its defaults, so a name equal to
# this host's was dropped and, with no entry yet, it failed with KeyError: 'machine' on a fresh machine. The entry
# is looked up by its exact name: asv's own lookup gives a name equal to the host's the file's only entry when
# there is one, and an outside user's results went under another session's machine (its RAM overwritten) while
# this script said they were this host's.
ram="$(python - "${ASV_CONFIG:-asv.conf.json}" "$machine" <<'EOF'
import json, os, sys
from asv.config import Config
from asv.machine import MachineCollection
known = {}
if os.path.isfile(MachineCollection.get_machine_file_path()):
    known = json.load(open(MachineCollection.get_machine_file_path()))
if sys.argv[2] not in known:
    MachineCollection.save(sys.argv[2], {"machine": sys.argv[2]})
path = os.path.join(Config.load(sys.argv[1]).results_dir, sys.argv[2], "machine.json")
print(json.load(open(path)).get("ram", "") if os.path.exists(path) else "")
EOF
)"
[ -n "$ram" ] || ram="$(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
python -m asv machine "${config[@]}" --yes --machine "$machine" --os "$(uname -sr)" --arch "$(uname -m)" \
    --cpu "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs || uname -p)" --num_cpu "$(nproc)" \
    --ram "$ram"
if [ -n "$repo_line" ]; then
    # the harness's commit, beside the plugin's: a harness with uncommitted changes says so
    harness="$(git rev-parse HEAD)"
    [ -z "$(git status --porcelain --untracked-files=no)" ] || harness="$harness+uncommitted"
    ledger="$results_dir/harness-commits.tsv"
    echo "asv_record: filing results under $plugin_repo's commit $commit (branch $plugin_branch), measured with" \
         "mha-harness at $harness (added to $ledger after the run)"
fi
# asv keeps no load with its figures (bench flags a point timed on a busy machine 'L'): say it here, before and after
load() { echo "asv_record: load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown) on $(nproc) cores $1"\
    "(asv stores none with its figures: a busy machine makes them slower and noisier; compare idle runs only)"; }
load "before asv run"
# ASV_ARGS is split into words, unglobbed: a -b regex such as 'Time[FB]' reaches asv as it is
set -f
# shellcheck disable=SC2086
python -m asv run "${config[@]}" --python=same --set-commit-hash "$commit" --machine "$machine" ${ASV_ARGS:-}
set +f
load "after asv run"
if [ -n "$repo_line" ]; then
    [ -f "$ledger" ] || printf 'date_utc\tmachine\tplugin_repo\tbranch\tplugin_commit\tharness_commit\n' >"$ledger"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$machine" "$plugin_repo" "$plugin_branch" \
        "$commit" "$harness" >>"$ledger"
fi
python -m asv publish "${config[@]}"
python benchmarks/asv_offline.py "$html"
echo "dashboard: $html/index.html (machine $machine)"
