#!/usr/bin/env bash
# The wheels a TPU VM's local package index lacks, downloaded beforehand on a machine with a package
# index, by package name at exact versions (bench/tpu.sh's install stage finds them with --find-links):
#   bash bench/tpu_wheels.sh [DIR]      (default .whl-tpu; DIR/engine and DIR/peer, ~28 MB together)
# Python 3.11, manylinux x86_64 (the TPU VM's host). Packages published only as source are built into
# wheels here (`pip wheel --no-deps`). Already downloaded files are kept, so a rerun is quick.
# DIR must stay out of git: `echo /.whl-tpu/ >> .git/info/exclude` (the README says so too).
set -euo pipefail
dir=${1:-.whl-tpu}
py=${PYTHON:-python3}

# The one place these versions are pinned. The engine's match constraints.txt.
ENGINE_WHEELS="math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2"
# Tunix 0.1.7 (the peer) and what its resolution against the TPU's local index lacks there: that index
# has safetensors 0.8.0 and transformers 5.17 (which needs it), Tunix needs safetensors<0.8.
PEER_WHEELS="google-tunix==0.1.7 google-metrax==0.2.4 grain==0.2.18 hf_transfer==0.1.9 kagglesdk==0.1.38
  perfetto==0.59.1 pylatexenc==2.11 qwix==0.1.8 tensorflow-datasets==4.9.10 tensorflow-metadata==1.21.0
  array-record==0.8.6 clu==0.0.12 dm-tree==0.1.10 portpicker==1.6.0 simple-parsing==0.1.9
  safetensors==0.7.0 transformers==5.12.1 certifi==2026.10.19.post1"
# Published as source only: promise, and the antlr4 runtime omegaconf pins (4.9.x).
PEER_SDISTS="promise==2.3 antlr4-python3-runtime==4.9.3"

platforms=""
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
  platforms="$platforms --platform $tag"
done

download() {  # FOLDER NAME==VERSION ...
  local folder=$1
  shift
  mkdir -p "$folder"
  # shellcheck disable=SC2086
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp $platforms -d "$folder" "$@"
}

download "$dir/engine" $ENGINE_WHEELS
download "$dir/peer" $PEER_WHEELS
"$py" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$dir/peer" $PEER_SDISTS

# One version of each package per folder: two would leave the choice to the resolver's order.
for folder in "$dir/engine" "$dir/peer"; do
  dupes=$(ls "$folder" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
  if [ -n "$dupes" ]; then
    echo "more than one version in $folder of: $dupes" >&2
    exit 1
  fi
done
du -sh "$dir/engine" "$dir/peer"
ls "$dir/engine" "$dir/peer"
