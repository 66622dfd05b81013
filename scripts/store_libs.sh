#!/usr/bin/env bash
# The network tier's store (mooncake-transfer-engine-non-cuda, the `network` extra) links Debian's RDMA and NUMA
# libraries even when it moves bytes over TCP: libibverbs1, librdmacm1, libnuma1. Installs the packages whose library
# the dynamic linker does not know; does nothing where the extra is not installed (it is Linux x86_64 only).
set -euo pipefail
[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || exit 0
known="$({ command -v ldconfig >/dev/null && ldconfig -p; } || /sbin/ldconfig -p)"
missing=""
for pair in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
    grep -q "${pair%%:*} " <<<"$known" || missing="$missing ${pair##*:}"
done
[ -n "$missing" ] || exit 0
echo "store libs: installing Debian's$missing" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086
$SUDO apt-get install -y -q $missing >&2 || { $SUDO apt-get update -q >&2 && $SUDO apt-get install -y -q $missing >&2; }
