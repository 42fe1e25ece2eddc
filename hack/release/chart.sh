#!/usr/bin/env bash
# Packages the chart for a release: charts/grpo-operator with its version and appVersion set to VERSION and its
# image repositories set to REGISTRY's, so that its defaults name the images `hack/images/build.sh --push` pushed
# for VERSION (REGISTRY/grpo-operator:VERSION, REGISTRY/grpo-trainer:VERSION-cuda). Prints the package's path.
#   Usage: hack/release/chart.sh VERSION REGISTRY OUT_DIR     e.g. 0.2.0 ghcr.io/acme dist
#   HELM  the helm command (default: helm on PATH)
# .github/workflows/release.yml pushes the package with `helm push PACKAGE oci://REGISTRY/charts`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd -P)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=../lib/release.sh
source "$here/../lib/release.sh"
[[ $# -eq 3 && -n $2 && -n $3 ]] || { echo "usage: $0 VERSION REGISTRY OUT_DIR" >&2; exit 2; }
version=$1 registry=${2%/} out=$3
release_version "$version" || exit 2
[[ $registry != *://* ]] || { echo "REGISTRY is a registry and path (ghcr.io/acme), without a transport: got $registry" >&2; exit 2; }

staged="$(mktemp -d)"
trap 'rm -rf "$staged"' EXIT
# -L: the chart's crds/grporun.yaml is a link to the repository's crds/, which the package must hold.
cp -RL "$repo/charts/grpo-operator" "$staged/"
values="$staged/grpo-operator/values.yaml"
# The values name the local images (grpo-operator, grpo-trainer); the package names the release's. Each line is
# replaced once, and the package is refused if either is not where this expects it.
for image in operator trainer-cuda; do
  name="$(release_image "$image" "$version")"; name=${name%%:*}
  sed -i "s|^  repository: $name\$|  repository: $registry/$name|" "$values"
  [[ $(grep -c "^  repository: $registry/$name\$" "$values") == 1 ]] \
    || { echo "charts/grpo-operator/values.yaml: no single '  repository: $name' line to point at $registry" >&2; exit 1; }
done
mkdir -p "$out"
"${HELM:-helm}" package "$staged/grpo-operator" --version "$version" --app-version "$version" --destination "$out" >&2
echo "$(cd "$out" && pwd)/grpo-operator-$version.tgz"
