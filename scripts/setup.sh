#!/usr/bin/env bash
# Installs every Debian package Tessera needs to build, test and benchmark, when missing.
# As root it runs apt-get; otherwise it prints the exact command to run.
set -euo pipefail

PKGS=(
  cmake ninja-build g++ make pkg-config ccache
  libtorch-dev libgloo-dev libopenblas0-openmp
  nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-numpy python3-venv bc time
  iproute2 strace  # strace: LauncherSignals.RankGroupIsKilledBeforeTheRankIsReaped reads the launcher's kill/wait order
  libtcmalloc-minimal4  # make bench: the allocator Tessera's CPU memory policy is compared with
)
# Fuzzing and sanitizers (make fuzz / make test-asan) want clang's runtime.
if [ "${TESSERA_SETUP_EXTRA:-}" = "fuzz" ]; then
  PKGS+=(clang libclang-rt-dev)
fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "tessera setup: missing packages: ${missing[*]}" >&2
  echo "run as root:  apt-get update && $cmd" >&2
  exit 1
fi
echo "tessera setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
$cmd
