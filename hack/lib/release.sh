# What a release names (sourced, not run): the version a tag gives, and the name and tag each image is pushed under.
# hack/images/build.sh --push and hack/release/chart.sh read it, so the images a release pushes are the ones its
# chart names (.github/workflows/release.yml runs both).
#   release_version VERSION       returns 2, saying why, unless VERSION is MAJOR.MINOR.PATCH[-PRERELEASE] (SemVer 2,
#                                 as helm wants a chart version, without +BUILD, which an image tag cannot hold)
#   release_image IMAGE VERSION   build.sh's IMAGE (operator | trainer-cpu | trainer-cuda) as NAME:TAG in a release

release_version() {
  local number='(0|[1-9][0-9]*)'
  [[ $1 =~ ^$number\.$number\.$number(-[0-9A-Za-z.-]+)?$ ]] && return 0
  echo "'$1' is not a release version: MAJOR.MINOR.PATCH with an optional -PRERELEASE (0.2.0, 0.2.0-rc.1; the tag v0.2.0 gives 0.2.0)" >&2
  return 2
}

release_image() {
  case $1 in
    operator) echo "grpo-operator:$2" ;;
    trainer-cpu) echo "grpo-trainer:$2-cpu" ;;
    trainer-cuda) echo "grpo-trainer:$2-cuda" ;;
    *) echo "no release name for image '$1'" >&2; return 2 ;;
  esac
}
