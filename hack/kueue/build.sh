#!/usr/bin/env bash
# Builds Kueue's manager (sigs.k8s.io/kueue/cmd/kueue, the version go.mod pins) for the test control plane, and copies
# its CRDs beside it, into a cache folder that it prints. A second call only prints it.
# Usage: hack/kueue/build.sh [--print-dir]; GRPO_CONTROLPLANE_CACHE moves the cache root as for hack/k8s.
# A module of its own: Kueue v0.17 pins k8s.io v0.35 modules, and one of its dependencies (kubeflow/trainer) no
# longer compiles against hack/k8s's v0.37 (docs/development.md says which).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../lib/progress.sh
source "$here/../lib/progress.sh"
version="$(awk '$1 == "require" && $2 == "sigs.k8s.io/kueue" {print $3}' "$here/go.mod")"
recipe_hash="$(cat "$here/go.mod" "$here/go.sum" "$here/tools.go" "$0" | sha256sum | cut -c1-12)"
root="${GRPO_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator}"
dir="$root/kueue-$version-$recipe_hash"
if [[ "${1:-}" == "--print-dir" ]]; then echo "$dir"; exit 0; fi
if [[ -x "$dir/kueue" ]]; then echo "$dir"; exit 0; fi
command -v go >/dev/null || { echo "go is not installed: cannot build Kueue" >&2; exit 3; }
mkdir -p "$root"
build_lock "$root/.build.lock" kueue
if [[ -x "$dir/kueue" ]]; then echo "$dir"; exit 0; fi
tmp="$(mktemp -d "$root/.build-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cd "$here"
export CGO_ENABLED=0
build_run kueue "Kueue $version's manager into $dir" \
  go build -mod=mod -trimpath -ldflags "-s -w" -o "$tmp/kueue" sigs.k8s.io/kueue/cmd/kueue >&2
source_dir="$(go list -mod=mod -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
# The CRDs, and the kustomization whose patches say which of them convert through Kueue's webhook.
mkdir -p "$tmp/crds/bases"
cp "$source_dir"/config/components/crd/bases/*.yaml "$tmp/crds/bases/"
cp -r "$source_dir"/config/components/crd/kustomization.yaml "$source_dir"/config/components/crd/patches "$tmp/crds/"
chmod -R u+w "$tmp/crds"
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "$dir"
