# Sourced by scripts/install_podman.sh and scripts/install_slurm.sh (not run by itself): what both
# do before their own work.
#   apt_prelude NAME WHY "$@"   -h/--help prints the calling script's header; any argument is refused
#                               (exit 2); then root (WHY: what needs it) and apt-get are required (exit 1).
#   apt_missing [APT OPTIONS --] PKG...   apt-get installs the packages dpkg does not have (an update
#                               first only when the install fails), quietly, naming them.
# TAG ("[NAME]") prefixes every line both print.

apt_prelude() {
  local name=$1 why=$2
  shift 2
  TAG="[$name]"
  case "${1:-}" in
    -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    "") ;;
    *) echo "error: $1: unknown argument ($name.sh takes none)" >&2; exit 2 ;;
  esac
  [ "$(id -u)" = 0 ] || { echo "$TAG error: run as root ($why)" >&2; exit 1; }
  command -v apt-get >/dev/null || { echo "$TAG error: needs apt-get (Debian/Ubuntu)" >&2; exit 1; }
}

apt_missing() {
  local opts=() missing=() p
  if [[ " $* " == *" -- "* ]]; then
    while [ "$1" != "--" ]; do opts+=("$1"); shift; done
    shift
  fi
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  ((${#missing[@]})) || return 0
  echo "$TAG apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${opts[@]}" "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q "${opts[@]}" "${missing[@]}" >/dev/null; }
}
