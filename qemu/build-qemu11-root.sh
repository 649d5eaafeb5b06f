#!/usr/bin/env bash
# Build (once) a Debian 13 (trixie) chroot holding QEMU 11 from trixie-backports: the
# vfio-user client VMM (`-device vfio-user-pci`) that QEMU 10 on Debian 12 lacks.
# tests/tests/guest_vfio_qemu11.rs boots a guest with it against a PCIe function
# lent by devlend. About 500 MB and 2-3 minutes the first time; later runs only check.
#
# Usage: qemu/build-qemu11-root.sh   (root; needs debootstrap, from install-deps.sh)
#
# Environment:
#   DEVLEND_QEMU11_ROOT   where the chroot lives (default /var/cache/devlend/qemu11-root)
#   DEVLEND_DEBIAN_MIRROR Debian mirror (default http://deb.debian.org/debian)
set -euo pipefail

readonly ROOT="${DEVLEND_QEMU11_ROOT:-/var/cache/devlend/qemu11-root}"
readonly MIRROR="${DEVLEND_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

log() { printf 'build-qemu11-root: %s\n' "$*" >&2; }

if [[ -x "$ROOT/usr/bin/qemu-system-x86_64" ]] &&
	chroot "$ROOT" qemu-system-x86_64 -device help 2>/dev/null | grep -q vfio-user-pci; then
	log "ready: $ROOT ($(chroot "$ROOT" qemu-system-x86_64 --version | head -n1))"
	exit 0
fi
command -v debootstrap >/dev/null || {
	log "error: debootstrap is missing (run qemu/install-deps.sh)"
	exit 1
}
[[ "$(id -u)" == 0 ]] || {
	log "error: must run as root"
	exit 1
}
tmp="$ROOT.partial"
rm -rf "$tmp"
mkdir -p "$(dirname "$ROOT")"
log "debootstrap trixie into $tmp"
debootstrap --variant=minbase trixie "$tmp" "$MIRROR" >/dev/null
echo "deb $MIRROR trixie-backports main" >"$tmp/etc/apt/sources.list.d/backports.list"
log "QEMU from trixie-backports"
chroot "$tmp" apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive chroot "$tmp" apt-get install -y -q -t trixie-backports \
	--no-install-recommends qemu-system-x86 >/dev/null
chroot "$tmp" apt-get clean
chroot "$tmp" qemu-system-x86_64 -device help | grep -q vfio-user-pci || {
	log "error: the chroot's QEMU has no vfio-user-pci"
	exit 1
}
rm -rf "$ROOT"
mv "$tmp" "$ROOT"
log "ready: $ROOT"
