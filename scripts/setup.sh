#!/usr/bin/env bash
# Installs the Debian packages lorakit builds, tests and demos with.
# Idempotent: does nothing (and needs no network) when every package is present.
set -euo pipefail
PKGS="build-essential cmake pkg-config libyaml-dev libjansson-dev libopenmpi-dev openmpi-bin \
libopenblas-dev libxxhash-dev libcmocka-dev libpcre2-dev gnuplot-nox clang libclang-rt-14-dev \
python3-dev python3-numpy python3-pytest python3-mpi4py"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
  echo "setup: all packages present"
  exit 0
fi
echo "setup: installing:$missing"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends $missing
