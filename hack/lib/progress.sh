# Progress for the long builds under hack/ (sourced, not run). A build that runs for minutes says so while it runs:
# what it builds, how long so far, and how long it took cold on the development machine (hack/lib/build-times).
# Every line goes to stderr and starts with "build: <name>:", so a caller that keeps the log (tests/support/builds.py)
# can show these lines and keep the rest for a failure's tail.
#   build_lock LOCKFILE NAME            take the build lock (one build at a time), saying so when it has to wait
#   build_run NAME WHAT COMMAND...      run COMMAND with a line every BUILD_PROGRESS_INTERVAL_S (default 30) seconds

_build_times="$(dirname "${BASH_SOURCE[0]}")/build-times"

_build_duration() {  # 754 -> 12m34s
  local s=$1
  if ((s >= 60)); then printf '%dm%02ds' $((s / 60)) $((s % 60)); else printf '%ds' "$s"; fi
}

_build_recorded() {  # the figure from hack/lib/build-times, as words
  local seconds
  seconds="$(awk -v name="$1" '$1 == name {print $2; exit}' "$_build_times" 2>/dev/null)"
  if [[ -n "$seconds" ]]; then echo "a cold build took $(_build_duration "$seconds") on the 2-core development machine"
  else echo "no recorded time for it in hack/lib/build-times"; fi
}

build_lock() {
  local lockfile=$1 name=$2
  exec 9>"$lockfile"
  if ! flock -n 9; then
    echo "build: $name: waiting for another build to finish (it holds $lockfile)" >&2
    flock 9
  fi
}

build_run() {
  local name=$1 what=$2; shift 2
  local interval=${BUILD_PROGRESS_INTERVAL_S:-30} start recorded status=0
  start=$(date +%s)
  recorded="$(_build_recorded "$name")"
  echo "build: $name: building $what ($recorded)" >&2
  # The ticker stops with the build, and on its own if this shell dies without stopping it.
  # It waits on its sleep (a trapped signal interrupts `wait`, not a sleep in the foreground) and holds no lock.
  (
    exec 9>&-
    nap=
    trap 'kill $nap 2>/dev/null; exit 0' TERM
    while true; do
      sleep "$interval" & nap=$!
      wait "$nap"
      kill -0 $$ 2>/dev/null || exit 0
      echo "build: $name: building $what, $(_build_duration $(($(date +%s) - start))) so far ($recorded)" >&2
    done
  ) &
  local ticker=$!
  "$@" || status=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  local took
  took="$(_build_duration $(($(date +%s) - start)))"
  if ((status == 0)); then echo "build: $name: built $what in $took" >&2
  else echo "build: $name: building $what failed after $took (exit $status)" >&2; fi
  return "$status"
}
