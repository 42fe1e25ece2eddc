#!/usr/bin/env bash
# Builds one set of the Go commands the test tiers run, from this folder's Go module, into a cache folder that it
# prints. A second call finds them there and only prints it; one missing from the folder is built alone.
#   hack/k8s/build.sh controlplane   kube-apiserver, kubectl, kube-controller-manager, etcd (tests/support/controlplane/control_plane.py)
#   hack/k8s/build.sh node           kubelet, kube-scheduler, kube-proxy, CoreDNS, and the pause and testbox image
#                                    archives (tests/support/node/node.py)
#   hack/k8s/build.sh helm           the helm CLI that installs the chart on the node (tests/support/node/operator_release.py)
#   hack/k8s/build.sh SET --print-dir   the folder, without building
#   GRPO_CONTROLPLANE_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/grpo-operator)
# One module for every set: the Kubernetes libraries and the rest they share compile once in the Go build cache,
# whichever set builds first (Kueue pins k8s.io modules this Kubernetes no longer compiles with: hack/kueue is a
# module of its own). The versions are go.mod's; the folder's name carries them and a hash of the recipe, so a
# changed recipe builds anew beside the old.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../lib/progress.sh
source "$here/../lib/progress.sh"
set_name=${1:-}
required() { awk -v module="$1" '$1 == module {print $2; exit}' "$here/go.mod"; }
kubernetes_version="$(required k8s.io/kubernetes)"

# name -> what it is built from (a package of this module, or a file made by make_image_archives)
declare -A sources
case $set_name in
  controlplane)
    sources=([kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver [kubectl]=k8s.io/kubernetes/cmd/kubectl
             [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager [etcd]=./etcd)
    folder="k8s-$kubernetes_version-etcd-$(required go.etcd.io/etcd/server/v3)" ;;
  node)
    sources=([kubelet]=k8s.io/kubernetes/cmd/kubelet [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
             [kube-proxy]=k8s.io/kubernetes/cmd/kube-proxy [coredns]=./coredns [pause.tar]=image [testbox.tar]=image)
    folder="node-k8s-$kubernetes_version-coredns-$(required github.com/coredns/coredns)" ;;
  helm)
    sources=([helm]=helm.sh/helm/v4/cmd/helm)
    folder="helm-$(required helm.sh/helm/v4)" ;;
  *) echo "usage: $0 controlplane|node|helm [--print-dir]" >&2; exit 2 ;;
esac
node_images="$here/../node"
recipe_hash="$(cat "$here/go.mod" "$here/go.sum" "$here/tools.go" "$here/etcd/main.go" "$here/coredns/main.go" "$0" \
  "$node_images/images/go.mod" "$node_images"/images/*/main.go "$node_images/image_archive.py" \
  | sha256sum | cut -c1-12)"
root="${GRPO_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator}"
dir="$root/$folder-$recipe_hash"
if [[ "${2:-}" == "--print-dir" ]]; then echo "$dir"; exit 0; fi
missing() { for name in "${!sources[@]}"; do [[ -e "$dir/$name" ]] || echo "$name"; done; }
if [[ -z "$(missing)" ]]; then echo "$dir"; exit 0; fi
command -v go >/dev/null || { echo "go is not installed: cannot build the $set_name set" >&2; exit 3; }
mkdir -p "$root"
build_lock "$root/.build.lock" "$set_name"   # one build at a time: a second pytest run waits, then finds them
mapfile -t wanted < <(missing)
if [[ ${#wanted[@]} -eq 0 ]]; then echo "$dir"; exit 0; fi
tmp="$(mktemp -d "$root/.build-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# The versions the commands report (the linker sets them where a release build's script would; -X of a package a
# command does not link is ignored, so one set of flags serves every command of a set).
minor="${kubernetes_version#v1.}"; minor="${minor%%.*}"
ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$(required helm.sh/helm/v4)"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$kubernetes_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
packages=() commands=() images=()
for name in "${wanted[@]}"; do
  if [[ ${sources[$name]} == image ]]; then images+=("$name"); else packages+=("${sources[$name]}"); commands+=("$name"); fi
done

cd "$here"
export CGO_ENABLED=0
if [[ ${#packages[@]} -gt 0 ]]; then
  # -mod=mod: go.sum is complete; this only lets `go build` read the module graph without a vendor folder.
  build_run "$set_name" "${commands[*]} into $dir" \
    go build -mod=mod -trimpath -ldflags "$ldflags" -o "$tmp/" "${packages[@]}" >&2
fi
if [[ ${#images[@]} -gt 0 ]]; then
  # Two images FROM scratch without an image builder: the pods' sandbox and the node tier's test program.
  build_run node-images "the pause and testbox images" \
    bash -c 'cd "$1" && go build -mod=readonly -trimpath -ldflags "-s -w" -o "$2/" ./pause ./testbox' _ \
    "$node_images/images" "$tmp" >&2
  python3 "$node_images/image_archive.py" localhost/grpo-node-pause:1 "$tmp/pause.tar" --entrypoint /pause "$tmp/pause"
  python3 "$node_images/image_archive.py" localhost/grpo-node-testbox:1 "$tmp/testbox.tar" --entrypoint /testbox \
    "$tmp/testbox"
fi
mkdir -p "$dir"
for name in "${wanted[@]}"; do mv "$tmp/$name" "$dir/"; done
echo "$dir"
