#!/usr/bin/env bash
# .whl: the wheels benchmarks/gpu-wheels.txt lists, made here for the lent GPU machine (Python 3.12,
# x86-64 manylinux, no network there), which gpu_pipeline.sh installs from the carried .whl. A fresh
# checkout has none (.whl is ignored): run this once before a GPU session. Wheels already there are kept.
#
#   bash benchmarks/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
if command -v pyenv > /dev/null; then  # pyenv's python3.12 answers only where a 3.12 is selected
    PYENV_VERSION=$(pyenv versions --bare | grep -m1 '^3\.12' || true) && export PYENV_VERSION
fi
platforms=()
for n in 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for spec in $(grep -v '^#' benchmarks/gpu-wheels.txt); do
    name=${spec%%==*} version=${spec##*==}
    stem=$(echo "$name" | tr '-' '_')
    if ls .whl | grep -qi "^${stem}-${version}-"; then continue; fi
    # a binary wheel for cp312 where there is one; else (connection-pool, deepspeed, pesq: sdists only) built
    # here by Python 3.12, so that a C extension's wheel is cp312 too
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$spec" 2> /dev/null \
        || python3.12 -m pip wheel -q --no-deps -w .whl "$spec" \
        || { echo "wheels.sh: no wheel for $spec (neither a cp312 manylinux download nor a build here)" >&2; exit 1; }
done
echo "$(ls .whl/*.whl | wc -l) wheels in .whl, $(du -sm .whl | cut -f1) MiB (a device call carries 64 MiB with the tree)"
