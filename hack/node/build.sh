#!/usr/bin/env bash
# Builds what the node test tier (tests/support/node.py) runs beside the control plane, into a cache folder that it
# prints: kubelet, kube-scheduler and kube-proxy (the control plane's Go module and versions, so the build reuses its
# compiled packages), CoreDNS (coredns/, a module of its own), and two image archives FROM scratch: the pods' sandbox
# ("pause") and testbox, the tier's test image. A second call finds them there and only prints the folder; a missing
# one is built alone. Usage: hack/node/build.sh [--print-dir]
#   GRPO_CONTROLPLANE_CACHE  cache root, as for hack/controlplane (default ${XDG_CACHE_HOME:-~/.cache}/grpo-operator)
# The folder's name carries the versions and a hash of every input, so a changed recipe builds anew beside the old.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
controlplane="$here/../controlplane"
# shellcheck source=../controlplane/versions.env
source "$controlplane/versions.env"
# shellcheck source=../lib/progress.sh
source "$here/../lib/progress.sh"
coredns_version="$(awk '$1 == "github.com/coredns/coredns" {print $2}' "$here/coredns/go.mod")"
recipe_hash="$(cat "$controlplane/versions.env" "$controlplane/go.mod" "$controlplane/go.sum" "$here/go.sum.extra" \
  "$here/coredns/go.mod" "$here/coredns/go.sum" "$here/coredns/main.go" "$here/images/go.mod" \
  "$here"/images/*/main.go "$here/image_archive.py" "$0" | sha256sum | cut -c1-12)"
root="${GRPO_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator}"
dir="$root/node-k8s-$KUBERNETES_VERSION-coredns-$coredns_version-$recipe_hash"
if [[ "${1:-}" == "--print-dir" ]]; then echo "$dir"; exit 0; fi
# name -> what it is built from; the Go packages of one module build in one `go build`.
declare -A kubernetes=(
  [kubelet]=k8s.io/kubernetes/cmd/kubelet
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kube-proxy]=k8s.io/kubernetes/cmd/kube-proxy
)
outputs=(kubelet kube-scheduler kube-proxy coredns pause.tar testbox.tar)
missing() { for name in "${outputs[@]}"; do [[ -e "$dir/$name" ]] || echo "$name"; done; }
if [[ -z "$(missing)" ]]; then echo "$dir"; exit 0; fi
command -v go >/dev/null || { echo "go is not installed: cannot build the node's binaries" >&2; exit 3; }
mkdir -p "$root"
build_lock "$root/.build.lock" node   # one build at a time (the control plane's too): a second run waits, then finds them
mapfile -t wanted < <(missing)
if [[ ${#wanted[@]} -eq 0 ]]; then echo "$dir"; exit 0; fi
tmp="$(mktemp -d "$root/.build-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
want() { local name; for name in "${wanted[@]}"; do [[ "$name" == "$1" ]] && return 0; done; return 1; }
minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
# nice: the build takes the machine's cores for minutes; the tests running beside it keep theirs.
k8s_packages=()
for name in "${!kubernetes[@]}"; do want "$name" && k8s_packages+=("${kubernetes[$name]}"); done
if [[ ${#k8s_packages[@]} -gt 0 ]]; then
  # The control plane's module, read-only: a copy of its go.mod and go.sum, plus the sums of the modules only the
  # node's commands import (hack/controlplane's own files key its cache and stay as they are).
  mkdir "$tmp/k8s"
  cp "$controlplane/go.mod" "$controlplane/go.sum" "$tmp/k8s/"
  cat "$here/go.sum.extra" >> "$tmp/k8s/go.sum"
  build_run node-kubernetes "${k8s_packages[*]##*/} $KUBERNETES_VERSION" \
    bash -c 'cd "$1" && shift && "$@"' _ "$tmp/k8s" \
    env CGO_ENABLED=0 nice -n 10 go build -mod=readonly -trimpath -ldflags "$ldflags" -o "$tmp/" "${k8s_packages[@]}" >&2
fi
if want coredns; then
  build_run node-coredns "coredns $coredns_version" \
    bash -c 'cd "$1" && shift && "$@"' _ "$here/coredns" \
    env CGO_ENABLED=0 nice -n 10 go build -mod=readonly -trimpath -ldflags "-s -w" -o "$tmp/coredns" . >&2
fi
if want pause.tar || want testbox.tar; then
  build_run node-images "the pause and testbox images" \
    bash -c 'cd "$1" && shift && "$@"' _ "$here/images" \
    env CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "-s -w" -o "$tmp/" ./pause ./testbox >&2
  python3 "$here/image_archive.py" localhost/grpo-node-pause:1 "$tmp/pause.tar" --entrypoint /pause "$tmp/pause"
  python3 "$here/image_archive.py" localhost/grpo-node-testbox:1 "$tmp/testbox.tar" --entrypoint /testbox \
    "$tmp/testbox"
  rm "$tmp/pause" "$tmp/testbox"
fi
mkdir -p "$dir"
for name in "${wanted[@]}"; do mv "$tmp/$name" "$dir/"; done
echo "$dir"
