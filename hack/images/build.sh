#!/usr/bin/env bash
# Builds the project's images from its own Dockerfiles with buildah, without Docker or a registry, into a cache
# folder, and prints "<reference> <archive>" per image (a docker-archive that `podman load` and
# `ctr -n k8s.io images import` read). A second call with the same inputs finds the archive and only prints it.
# trainer-cuda (12 GB, which no test node imports) stays in the build's store without an archive: its line is
# "<reference>" alone, and a record file in the cache folder stands for it.
#   Usage: hack/images/build.sh IMAGE...        IMAGE: operator | trainer-cpu | trainer-cuda
#          hack/images/build.sh --push DESTINATION VERSION [--dry-run] IMAGE...
#                                               builds each IMAGE, then pushes it to DESTINATION/NAME:TAG, the name
#                                               a release of VERSION gives it (hack/lib/release.sh), and prints
#                                               "<reference> <pushed>" per image. DESTINATION is a containers
#                                               transport and a prefix: docker://ghcr.io/OWNER (a registry, logged in
#                                               with `buildah login`), oci:DIR (an OCI layout per image in the folder DIR).
#                                               --dry-run prints the push commands, building and pushing nothing.
#          hack/images/build.sh --podman-flags  the podman flags that run them from the build's store
#          hack/images/build.sh --clean         removes the store, archives and logs
#   GRPO_IMAGES_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/grpo-operator/images)
#   TORCH_CPU_INDEX (trainer-cpu), TORCH_INDEX_URL and VLLM_WHEEL (trainer-cuda): trainer_image/Dockerfile's build args
#   GRPO_IMAGES_HOLDER the id of a process that uses the printed images until it ends (a test run): while it runs,
#                      no other call's pruning removes them
# Each image's key is a hash of its base, its Dockerfile, everything that Dockerfile copies and its build args.
# The base is a Debian 12 rootfs made by mmdebstrap and a python:3.11-slim-bookworm stand-in on top of it
# (python-standin.Containerfile). The layer store stays in the cache folder, so a changed source rebuilds only the
# layers after the COPY that changed (torch is a layer of its own). Progress and timings go to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd -P)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=../lib/progress.sh
source "$here/../lib/progress.sh"
# shellcheck source=../lib/release.sh
source "$here/../lib/release.sh"
root="${GRPO_IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator/images}"
store="$root/store"
runroot="${XDG_RUNTIME_DIR:-/run}/grpo-operator-images"
# Big temporary files of a commit go to the cache disk, not /var/tmp, in a folder per call removed at its end.
tmp_root="$root/tmp"
keep_archives=2   # per image: the newest keys stay (other branches build other keys), older ones not in use are removed
# A lease per image and holder (GRPO_IMAGES_HOLDER): "<name>-<key>.<pid>", holding the process's start time, so that
# a reused process id is not taken for the holder.
leases="$root/leases"

suite=bookworm
mirror=http://deb.debian.org
debian_packages=python3,python3-pip,python3-venv,ca-certificates
# Package downloads inside RUN use the machine's CA bundle (egress may present its own CA): mounted read-only for
# the build only, so nothing of it lands in an image.
ca_bundle=/etc/ssl/certs/ca-certificates.crt

storage=(--root "$store" --runroot "$runroot" --storage-driver overlay)
# runc, not crun: crun refuses a cgroup v1 host with a cgroup2 hierarchy mounted too ("cgroups in hybrid mode").
export BUILDAH_RUNTIME=runc
podman_flags=("${storage[@]}" --runtime runc --cgroup-manager cgroupfs --events-backend none)
bah() { buildah "${storage[@]}" "$@"; }
pod() { podman "${podman_flags[@]}" "$@"; }
# `--podman-flags`: the global podman flags that run the built images from this store, one a line.
if [[ ${1:-} == --podman-flags ]]; then printf '%s\n' "${podman_flags[@]}"; exit 0; fi
# `--clean`: removes the store, the archives and the logs (the next build starts from mmdebstrap).
if [[ ${1:-} == --clean ]]; then
  [[ -d $root ]] || exit 0
  bah rm --all >/dev/null 2>&1 || true
  bah rmi --all --force >/dev/null 2>&1 || true
  rm -rf "${store:?}" "${runroot:?}" "$root"/*.docker.tar "$root"/*.store "$root/logs" "$leases" "$tmp_root"
  echo "images: removed $root's store, archives and logs" >&2
  exit 0
fi

usage() {
  echo "usage: $0 [--push DESTINATION VERSION [--dry-run]] IMAGE...   (IMAGE: operator | trainer-cpu | trainer-cuda)" >&2
  exit 2
}
push_to='' version='' dry_run=false
while [[ ${1:-} == --* ]]; do
  case $1 in
    --push) [[ $# -ge 3 && -n $2 ]] || usage; push_to=$2 version=$3; shift 3; release_version "$version" || exit 2 ;;
    --dry-run) dry_run=true; shift ;;
    *) usage ;;
  esac
done
if $dry_run && [[ -z $push_to ]]; then echo "--dry-run goes with --push (it prints the push commands)" >&2; exit 2; fi
[[ $# -gt 0 ]] || usage
for image in "$@"; do [[ $image == operator || $image == trainer-cpu || $image == trainer-cuda ]] || usage; done

if ! $dry_run; then
  for tool in mmdebstrap buildah podman runc; do
    command -v "$tool" >/dev/null || { echo "$tool is not installed (make setup-apt installs it): cannot build images" >&2; exit 3; }
  done
  [[ $(id -u) == 0 ]] || { echo "building images needs root (mmdebstrap, buildah's overlay store)" >&2; exit 3; }
fi
have_image() { bah inspect --type image "$1" >/dev/null 2>&1; }

# A hash of files (names and contents; caches and build outputs excluded, as .dockerignore does) and strings.
hash_inputs() {
  { for path in "$@"; do
      if [[ -e "$repo/$path" ]]; then
        (cd "$repo" && find "$path" -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 | sort -z | xargs -0 sha256sum)
      else
        echo "$path"
      fi
    done; } | sha256sum | cut -c1-12
}

# run_logged NAME WHAT LOG COMMAND...: runs COMMAND with its output in LOG, saying what it builds, how long so far and
# how long it took here (hack/lib/progress.sh, as build NAME), and its STEP lines as they come. Also samples the disk
# the cache is on, so each build reports its peak use.
run_logged() {
  local name=$1 what=$2 log=$3; shift 3
  local used0 peak_file="$TMPDIR/.peak" sampler status=0
  used0=$(df -B1M --output=used "$root" | tail -1)
  echo "$used0" > "$peak_file"
  ( while sleep 5; do
      used=$(df -B1M --output=used "$root" | tail -1)
      (( used > $(cat "$peak_file") )) && echo "$used" > "$peak_file"
    done ) &
  sampler=$!
  build_run "$name" "$what" _logged "$name" "$log" "$@" || status=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null || true
  echo "build: $name: disk use rose by up to $(( $(cat "$peak_file") - used0 )) MiB while it ran (log: $log)" >&2
  if (( status != 0 )); then
    echo "the last lines of $log:" >&2
    tail -n 25 "$log" >&2
  fi
  return "$status"
}

_logged() {
  local name=$1 log=$2; shift 2
  # Without the lock descriptors (7, 8): mmdebstrap hands apt a pipe on the next free descriptor and has dpkg's
  # /bin/sh write to it, and dash cannot redirect to a descriptor above 9 ("Bad fd number": the rootfs failed).
  "$@" > "$log" 2>&1 7>&- 8>&- &
  local worker=$!
  # Each stage line-buffered (cut would hold the STEP lines back until the build ends).
  tail -n +1 -f --pid="$worker" "$log" 2>/dev/null | grep --line-buffered -E '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/[0-9]+' \
    | sed -u -E "s/^(.{150}).*/\1/; s/^/build: $name: /" >&2 || true
  wait "$worker"
}

# The rootfs takes minutes: its key is what mmdebstrap is asked for, not this whole script.
debian_key=$(hash_inputs "mmdebstrap minbase" "$suite" "$mirror" "$debian_packages")
debian_ref="localhost/grpo-build/debian:$suite-$debian_key"
python_key=$(hash_inputs "$debian_key" hack/images/python-standin.Containerfile)
python_ref="localhost/grpo-build/python:3.11-$suite-$python_key"

build_base() {
  have_image "$python_ref" && return 0
  exec 8>"$root/.build-base.lock"
  flock 8   # one base build at a time; a second caller waits, then finds it
  have_image "$python_ref" && { exec 8>&-; return 0; }
  if ! have_image "$debian_ref"; then
    local rootfs="$TMPDIR/rootfs-$debian_key.tar"
    run_logged image-rootfs "a Debian 12 rootfs (mmdebstrap)" "$root/logs/debian-$debian_key.log" \
      mmdebstrap --variant=minbase --include="$debian_packages" --components=main \
        --aptopt='APT::Install-Recommends "false"' "$suite" "$rootfs" \
        "deb $mirror/debian $suite main" "deb $mirror/debian $suite-updates main" \
        "deb $mirror/debian-security $suite-security main"
    pod import --change 'CMD ["/bin/bash"]' "$rootfs" "$debian_ref" >/dev/null
    rm -f "$rootfs"
  fi
  run_logged image-python "the python:3.11-slim-bookworm stand-in" "$root/logs/python-$python_key.log" \
    bah bud --layers --force-rm --network host --build-arg DEBIAN_IMAGE="$debian_ref" \
      -f "$here/python-standin.Containerfile" -t "$python_ref" "$here"
  exec 8>&-
}

# build_image NAME PROGRESS REPOSITORY DOCKERFILE OUTPUT BUILD_ARG... -- INPUT...: the Dockerfile, built as it is in
# the repository; PROGRESS names the build in its progress lines and in hack/lib/build-times. OUTPUT: `archive` (a
# docker-archive in the cache folder, what a second call finds) or `store` (the image in the store only, and an empty
# record file in the cache folder in its place). With --push, then pushed (with --dry-run, only the push command
# printed).
build_image() {
  local name=$1 progress=$2 repository=$3 dockerfile=$4 output=$5; shift 5
  local build_args=() inputs=()
  while [[ $1 != -- ]]; do build_args+=(--build-arg "$1"); shift; done; shift
  inputs=("$@")
  local key ref archive layers=--layers uncached=()
  # buildah 1.28 keys a cached RUN step without the stage a `--mount=type=bind,from=` reads: a new wheel from the
  # build stage reused the old install layer, and the operator image ran the previous build's code. Such a
  # Dockerfile builds without the layer cache (the operator image: about 2 min).
  if grep -q -- '--mount=type=bind,from=' "$repo/$dockerfile"; then layers=--layers=false uncached=(no-layer-cache); fi
  key=$(hash_inputs "$python_key" "$dockerfile" "${uncached[@]}" "${build_args[@]}" "${inputs[@]}")
  ref="$repository:$key"
  local suffix=${output/archive/docker.tar}
  local record="$root/$name-$key.$suffix"   # the archive, or the store image's record
  archive=''
  [[ $output == store ]] || archive=$record
  local push=()
  [[ -z $push_to ]] || push=(buildah "${storage[@]}" push "$ref" "$push_to/$(release_image "$name" "$version")")
  if $dry_run; then
    printf '%q ' "${push[@]}" | sed 's/ $//'
    echo
    return 0
  fi
  built() { if [[ -n $archive ]]; then [[ -s $archive ]]; else [[ -e $record ]] && have_image "$ref"; fi; }
  if ! claim "$name" "$key" "$repository" "$suffix" built; then
    exec 7>"$root/.build-$name.lock"
    flock 7   # one build of an image at a time: a second caller waits, then finds the archive
  fi
  if ! claim "$name" "$key" "$repository" "$suffix" built; then
    build_base
    if ! have_image "$ref"; then
      run_logged "$progress" "$name from $dockerfile" "$root/logs/$name-$key.log" \
        bah bud "$layers" --force-rm --network host -v "$ca_bundle:$ca_bundle:ro" \
          --build-arg PYTHON_IMAGE="$python_ref" "${build_args[@]}" \
          -f "$repo/$dockerfile" -t "$ref" "$repo"
    fi
    local partial=''
    if [[ -n $archive ]]; then
      local start=$SECONDS
      partial="$TMPDIR/${archive##*/}"   # beside the store, removed with TMPDIR if the push fails
      bah push --quiet "$ref" "docker-archive:$partial:$ref" >&2
      echo "build: $progress: wrote $archive ($(du -m "$partial" | cut -f1) MiB) in $((SECONDS - start)) s" >&2
    fi
    # Published under the records lock, with its lease, so that no prune between the two removes it.
    publish() { if [[ -n $partial ]]; then mv "$partial" "$archive"; else touch "$record"; fi; }
    claim "$name" "$key" "$repository" "$suffix" built publish \
      || { echo "images: $ref vanished as it was built" >&2; exit 1; }
  fi
  exec 7>&-
  if [[ -n $push_to ]]; then
    # The store holds the image the archive was written from (prune removes both together).
    have_image "$ref" || bah pull --quiet "docker-archive:$archive" >&2
    "${push[@]}" >&2
    echo "build: $progress: pushed $ref to ${push[-1]}" >&2
    echo "$ref ${push[-1]}"
  else
    echo "$ref${archive:+ $archive}"
  fi
}

# claim NAME KEY REPOSITORY SUFFIX BUILT [PUBLISH]: runs PUBLISH (a command: a new build's record into place), then
# where BUILT (a command) finds the image, marks it the newest, leases it to GRPO_IMAGES_HOLDER and prunes the older
# ones, and succeeds; fails where it is not built. Under the records lock, which every prune takes: between a
# prune's choice of what to remove and the removal, no call finds and leases it.
claim() {
  local name=$1 key=$2 repository=$3 suffix=$4 built=$5 publish=${6:-true} found=0
  exec 6>"$root/.records.lock"
  flock 6
  "$publish"
  if "$built"; then
    touch "$root/$name-$key.$suffix"   # in use: prune keeps the newest
    if [[ -n ${GRPO_IMAGES_HOLDER:-} ]]; then
      local started
      started=$(process_start "$GRPO_IMAGES_HOLDER") \
        || { echo "GRPO_IMAGES_HOLDER=$GRPO_IMAGES_HOLDER: no such process" >&2; exit 2; }
      mkdir -p "$leases"
      echo "$started" > "$leases/$name-$key.$GRPO_IMAGES_HOLDER"
    fi
    prune "$name" "$repository" "$suffix"
  else
    found=1
  fi
  exec 6>&-
  return "$found"
}

# process_start PID: the process's start time (clock ticks since boot: /proc/PID/stat's 22nd field), which tells it
# from a later process given the same id.
process_start() {
  local stat fields
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  read -ra fields <<< "${stat##*) }"   # the fields after the command's name, which may hold spaces: state first
  echo "${fields[19]}"
}

# holder NAME KEY: the id of a running process that holds a lease on the image (its leases of ended processes are
# removed); fails where none does.
holder() {
  local lease pid
  for lease in "$leases/$1-$2".*; do
    [[ -e $lease ]] || continue
    pid=${lease##*.}
    if [[ $(process_start "$pid") == "$(cat "$lease")" ]]; then echo "$pid"; return 0; fi
    rm -f "$lease"
  done
  return 1
}

# Keeps the newest records of an image (archives: SUFFIX docker.tar; store images' records: store, the newest one
# only, 12 GB each), and their images in the store, and the older ones a running process holds a lease on, and
# removes the rest. Their cached intermediate layers stay (a later build may reuse them; `--clean` removes
# everything). The caller holds the records lock (claim).
prune() {
  local name=$1 repository=$2 suffix=$3 old archive key pid keep=$keep_archives
  [[ $suffix != store ]] || keep=1
  mapfile -t old < <(ls -t "$root/$name"-*."$suffix" 2>/dev/null | tail -n +$((keep + 1)))
  for archive in "${old[@]}"; do
    key=${archive##*/$name-}; key=${key%%.*}
    if pid=$(holder "$name" "$key"); then
      echo "images: kept the older $name image $key: process $pid uses it" >&2
      continue
    fi
    rm -f "$archive"
    bah rmi "$repository:$key" >/dev/null 2>&1 || true
    echo "images: removed the older $name image $key" >&2
  done
}

if ! $dry_run; then
  mkdir -p "$root/logs" "$tmp_root"
  TMPDIR="$(mktemp -d "$tmp_root/XXXXXX")"
  export TMPDIR
  trap 'rm -rf "${TMPDIR:?}"' EXIT
fi

sources=(pyproject.toml operator/grpo_operator trainer_image/grpo_trainer)
for image in "$@"; do
  case $image in
    operator)
      build_image operator operator-image localhost/grpo-operator Dockerfile archive \
        -- "${sources[@]}" crds/grporun.yaml .dockerignore ;;
    trainer-cpu)
      # download.pytorch.org is not needed: TORCH_CPU_INDEX= takes PyPI's torch (the Dockerfile's documented route).
      # TRACKING=true: the learner has the experiment trackers, so spec.tracking runs from this image (the node
      # tier's tracked run reports to a real MLflow server).
      build_image trainer-cpu trainer-image localhost/grpo-trainer trainer_image/Dockerfile archive VARIANT=cpu "TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-}" TRACKING=true \
        -- "${sources[@]}" trainer_image/requirements .dockerignore ;;
    trainer-cuda)
      # PyPI's torch and vllm (CUDA 13.0: NVIDIA driver >= 580) unless TORCH_INDEX_URL and VLLM_WHEEL name the
      # builds for another CUDA (trainer_image/Dockerfile). TRACKING=true as for the CPU variant.
      build_image trainer-cuda trainer-cuda-image localhost/grpo-trainer trainer_image/Dockerfile store VARIANT=cuda \
        "TORCH_INDEX_URL=${TORCH_INDEX_URL:-}" "VLLM_WHEEL=${VLLM_WHEEL:-}" TRACKING=true \
        -- "${sources[@]}" trainer_image/requirements .dockerignore ;;
  esac
done
