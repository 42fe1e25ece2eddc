#!/usr/bin/env bash
# Prints the `uv pip install` arguments that install torch $1 for this machine, the CPU build where one is at hand:
#   1. $TORCH_CPU_INDEX: a wheel index that serves the CPU build (e.g. PyTorch's own CPU index);
#   2. a pre-staged torch-<version>+cpu wheel in a folder of $TORCH_WHEEL_DIR or $PIP_FIND_LINKS;
#   3. otherwise PyPI's torch, a CUDA build (~3 GB with its nvidia libraries) that runs fine on a CPU.
# The choice goes to stderr, so a set-up log says which torch it installed and why.
set -euo pipefail
version=${1:?usage: torch-source.sh TORCH_VERSION}

if [ -n "${TORCH_CPU_INDEX:-}" ]; then
    echo "torch: ${version}+cpu from TORCH_CPU_INDEX=${TORCH_CPU_INDEX}" >&2
    echo "--extra-index-url ${TORCH_CPU_INDEX} torch==${version}+cpu"
    exit 0
fi

for dir in ${TORCH_WHEEL_DIR:-} ${PIP_FIND_LINKS:-}; do
    [ -d "$dir" ] || continue
    if compgen -G "${dir}/torch-${version}+cpu-*.whl" >/dev/null; then
        echo "torch: ${version}+cpu from the pre-staged wheel in ${dir}" >&2
        echo "--find-links ${dir} torch==${version}+cpu"
        exit 0
    fi
done

echo "torch: ${version} from PyPI (a CUDA build; set TORCH_CPU_INDEX to a CPU wheel index for a ~3 GB smaller set-up)" >&2
echo "torch==${version}"
