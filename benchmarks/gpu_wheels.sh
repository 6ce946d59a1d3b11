#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_session.sh needs on the GPU machine into .whl/ of this checkout (git-ignored).
#
#   benchmarks/gpu_wheels.sh            # run here, where pip reaches the registry; the GPU machine has no network
#
# The GPU machine's image (Python 3.12, torch 2.11, jax 0.11.2, onnxruntime 1.30, tqdm, tabulate, packaging,
# pyyaml, build, zipp, filelock ...) lacks asv and its own needs (asv_runner, json5, importlib_metadata with lazy_importer, pympler; virtualenv
# with distlib, platformdirs, python-discovery, in case an asv plugin imports it). One version of each: two versions of one name stop the whole `pip install --no-deps`.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
PY="${PYTHON:-python3}"
PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
WHEELS=(asv==0.6.6 asv_runner==0.3.2 json5==0.17.3 importlib_metadata==10.2.0 lazy_importer==0.1.0 pympler==1.1
        virtualenv==21.15.11 distlib==0.4.4 platformdirs==4.14.9 python-discovery==1.9.6)
"$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$dest" "${WHEELS[@]}"
# one version of each name, or the install on the GPU machine fails
dupes=$(ls "$dest"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "gpu_wheels: more than one version of: $dupes (remove the older ones from $dest/)" >&2
    exit 1
fi
ls -l "$dest"
du -sh "$dest"
