#!/usr/bin/env bash
# Record this machine's asv results into results/asv/<machine>/ and publish the dashboard to results/html/.
#
#   benchmarks/asv_record.sh [MACHINE_NAME]      # default: this host's name
#
# Runs offline in the current environment (asv.conf.json: environment_type "existing"); results are saved
# against the current commit (--set-commit-hash). Narrow a run with MHA_ASV_BACKENDS / MHA_ASV_SEQ_LENS,
# e.g. MHA_ASV_SEQ_LENS=128,512,2048 benchmarks/asv_record.sh cpu-box. Results from other machines (a GPU box)
# copied into results/asv/<their machine>/ are merged by the same `asv publish` into one dashboard with a
# machine selector. Preview on this machine only (asv preview listens on every interface):
#   python -m http.server --bind 127.0.0.1 --directory results/html 8080   # http://127.0.0.1:8080
# ASV_CONFIG=PATH uses another asv config (one whose results_dir/html_dir point elsewhere: what
# benchmarks/regenerate_results.sh does for a --results folder other than results/), with ASV_HTML_DIR its html_dir.
set -euo pipefail
cd "$(dirname "$0")/.."
machine="${1:-$(hostname)}"
config=()
if [ -n "${ASV_CONFIG:-}" ]; then config=(--config "$ASV_CONFIG"); fi
html="${ASV_HTML_DIR:-results/html}"
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
# asv keeps no load with its figures (bench flags a point timed on a busy machine 'L'): say it here, before and after
load() { echo "asv_record: load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown) on $(nproc) cores $1"\
    "(asv stores none with its figures: a busy machine makes them slower and noisier; compare idle runs only)"; }
load "before asv run"
python -m asv run "${config[@]}" --python=same --set-commit-hash "$(git rev-parse HEAD)" --machine "$machine" ${ASV_ARGS:-}
load "after asv run"
python -m asv publish "${config[@]}"
python benchmarks/asv_offline.py "$html"
echo "dashboard: $html/index.html (machine $machine)"
