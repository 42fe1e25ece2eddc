#!/usr/bin/env bash
# Builds the helm CLI (helm.sh/helm/v4/cmd/helm, the version go.mod pins) into a cache folder and prints it; a second
# call only prints it. The node tier installs the chart with it (the suite's helm-python renders, but cannot install).
# Usage: hack/helm/build.sh [--print-dir]; GRPO_CONTROLPLANE_CACHE moves the cache root as for hack/controlplane.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../lib/progress.sh
source "$here/../lib/progress.sh"
version="$(awk '$1 == "require" && $2 == "helm.sh/helm/v4" {print $3}' "$here/go.mod")"
recipe_hash="$(cat "$here/go.mod" "$here/go.sum" "$here/tools.go" "$0" | sha256sum | cut -c1-12)"
root="${GRPO_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator}"
dir="$root/helm-$version-$recipe_hash"
if [[ "${1:-}" == "--print-dir" ]]; then echo "$dir"; exit 0; fi
if [[ -x "$dir/helm" ]]; then echo "$dir"; exit 0; fi
command -v go >/dev/null || { echo "go is not installed: cannot build helm" >&2; exit 3; }
mkdir -p "$root"
build_lock "$root/.build.lock" helm
if [[ -x "$dir/helm" ]]; then echo "$dir"; exit 0; fi
tmp="$(mktemp -d "$root/.build-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cd "$here"
build_run helm "helm $version" env CGO_ENABLED=0 nice -n 10 go build -mod=readonly -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$version" -o "$tmp/helm" helm.sh/helm/v4/cmd/helm >&2
mkdir -p "$dir"
mv "$tmp/helm" "$dir/"
echo "$dir"
