#!/usr/bin/env bash
# Builds SeaweedFS's `weed` (github.com/seaweedfs/seaweedfs/weed, the version go.mod pins) for the tests' S3
# endpoint (tests/support/servers/s3_server.py), into a cache folder that it prints. A second call only prints it.
# Usage: hack/s3/build.sh [--print-dir]; GRPO_CONTROLPLANE_CACHE moves the cache root as for hack/k8s.
# A module of its own: SeaweedFS pins its own cloud SDKs and gRPC, which have nothing to do with hack/k8s's.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../lib/progress.sh
source "$here/../lib/progress.sh"
version="$(awk '$1 == "require" && $2 == "github.com/seaweedfs/seaweedfs" {print $3}' "$here/go.mod")"
recipe_hash="$(cat "$here/go.mod" "$here/go.sum" "$here/tools.go" "$0" | sha256sum | cut -c1-12)"
root="${GRPO_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator}"
dir="$root/seaweedfs-$version-$recipe_hash"
if [[ "${1:-}" == "--print-dir" ]]; then echo "$dir"; exit 0; fi
if [[ -x "$dir/weed" ]]; then echo "$dir"; exit 0; fi
command -v go >/dev/null || { echo "go is not installed: cannot build SeaweedFS" >&2; exit 3; }
mkdir -p "$root"
build_lock "$root/.build.lock" seaweedfs
if [[ -x "$dir/weed" ]]; then echo "$dir"; exit 0; fi
tmp="$(mktemp -d "$root/.build-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cd "$here"
export CGO_ENABLED=0
build_run seaweedfs "SeaweedFS $version's weed into $dir" \
  go build -mod=mod -trimpath -ldflags "-s -w" -o "$tmp/weed" github.com/seaweedfs/seaweedfs/weed >&2
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "$dir"
