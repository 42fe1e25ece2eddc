#!/usr/bin/env bash
# Builds actionlint (github.com/rhysd/actionlint/cmd/actionlint, the version go.mod pins), which the tests run over
# .github/workflows (tests/github), into a cache folder that it prints. A second call only prints it.
# Usage: hack/actionlint/build.sh [--print-dir]; GRPO_CONTROLPLANE_CACHE moves the cache root as for hack/k8s.
# A module of its own: a few small dependencies, none shared with the other Go tools.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../lib/progress.sh
source "$here/../lib/progress.sh"
version="$(awk '$1 == "require" && $2 == "github.com/rhysd/actionlint" {print $3}' "$here/go.mod")"
recipe_hash="$(cat "$here/go.mod" "$here/go.sum" "$here/tools.go" "$0" | sha256sum | cut -c1-12)"
root="${GRPO_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator}"
dir="$root/actionlint-$version-$recipe_hash"
if [[ "${1:-}" == "--print-dir" ]]; then echo "$dir"; exit 0; fi
if [[ -x "$dir/actionlint" ]]; then echo "$dir"; exit 0; fi
command -v go >/dev/null || { echo "go is not installed: cannot build actionlint" >&2; exit 3; }
mkdir -p "$root"
build_lock "$root/.build.lock" actionlint
if [[ -x "$dir/actionlint" ]]; then echo "$dir"; exit 0; fi
tmp="$(mktemp -d "$root/.build-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cd "$here"
export CGO_ENABLED=0
# The version `actionlint -version` reports (a release build's script sets it the same way).
build_run actionlint "actionlint $version into $dir" \
  go build -mod=mod -trimpath -ldflags "-s -w -X github.com/rhysd/actionlint.version=$version" \
    -o "$tmp/actionlint" github.com/rhysd/actionlint/cmd/actionlint >&2
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "$dir"
