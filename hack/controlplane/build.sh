#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, kubectl, kube-controller-manager, etcd) from Go modules into a cache
# folder and prints that folder. A second call finds the binaries there and only prints it; a binary missing from the
# folder is built alone. Usage: hack/controlplane/build.sh [--print-dir]
#   GRPO_CONTROLPLANE_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/grpo-operator)
# The folder's name carries the versions and a hash of this recipe, so a changed recipe builds anew beside the old.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=../lib/progress.sh
source "$here/../lib/progress.sh"
recipe_hash="$(cat "$here/versions.env" "$here/go.mod" "$here/go.sum" "$here/etcd/main.go" "$0" | sha256sum | cut -c1-12)"
root="${GRPO_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator}"
dir="$root/k8s-$KUBERNETES_VERSION-etcd-$ETCD_VERSION-$recipe_hash"
if [[ "${1:-}" == "--print-dir" ]]; then echo "$dir"; exit 0; fi
declare -A packages=(
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kubectl]=k8s.io/kubernetes/cmd/kubectl
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [etcd]=./etcd
)
missing() { for name in "${!packages[@]}"; do [[ -x "$dir/$name" ]] || echo "${packages[$name]}"; done; }
if [[ -z "$(missing)" ]]; then echo "$dir"; exit 0; fi
command -v go >/dev/null || { echo "go is not installed: cannot build the control plane" >&2; exit 3; }
grep -q "k8s.io/kubernetes $KUBERNETES_VERSION" "$here/go.mod" || { echo "go.mod does not pin k8s.io/kubernetes $KUBERNETES_VERSION" >&2; exit 2; }
grep -q "k8s.io/api => k8s.io/api $KUBERNETES_STAGING_VERSION" "$here/go.mod" || { echo "go.mod does not pin the staging modules at $KUBERNETES_STAGING_VERSION" >&2; exit 2; }
grep -q "go.etcd.io/etcd/server/v3 $ETCD_VERSION" "$here/go.mod" || { echo "go.mod does not pin etcd $ETCD_VERSION" >&2; exit 2; }
mkdir -p "$root"
build_lock "$root/.build.lock" controlplane   # one build at a time: a second pytest run waits, then finds them
mapfile -t wanted < <(missing)
if [[ ${#wanted[@]} -eq 0 ]]; then echo "$dir"; exit 0; fi
tmp="$(mktemp -d "$root/.build-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
cd "$here"
# -mod=mod: go.sum is complete, this only lets `go build` read the module graph without a vendor folder.
# nice: the build takes the machine's cores for a long while; the tests running beside it keep theirs.
export CGO_ENABLED=0
build_run controlplane "${wanted[*]##*/} into $dir" \
  nice -n 10 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$tmp/" "${wanted[@]}" >&2
mkdir -p "$dir"
mv "$tmp"/* "$dir/"
echo "$dir"
