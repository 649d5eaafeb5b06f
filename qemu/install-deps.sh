#!/usr/bin/env bash
# Install what devlend's guest tests need on a Debian 12 (bookworm) host:
#   - QEMU 10 (qemu-system-x86, qemu-utils, qemu-storage-daemon) from the
#     <codename>-backports suite; the plain bookworm QEMU (7.2) is too old;
#   - the tools qemu/build-guest.sh uses to build the guest kernel + initramfs
#     (busybox-static, cpio, kmod, xz-utils, zstd) and the host tools the tests
#     use (iproute2, e2fsprogs);
#   - PostgreSQL (postgresql): the pool's tests start a private server from it;
#   - libvirt 9.0 (libvirt-daemon, libvirt-daemon-driver-qemu, libvirt-clients): the
#     libvirt test configures it and starts its daemons itself (tests/src/libvirt.rs);
#   - Prometheus (prometheus, with promtool): the metrics test runs a private server;
#   - libfaketime (faketime): tests/tests/pool_outage/ runs a lender 5 minutes off.
#
# Idempotent and non-interactive. When everything is present it only checks and
# exits within a fraction of a second (CI and the test harness call it on every
# run); installing needs root.
#
# Usage: qemu/install-deps.sh [--check]
#   --check   only report what is missing; exit 1 if anything is.
#
# Environment:
#   DEVLEND_QEMU_MIN_MAJOR   lowest acceptable QEMU major version (default 10)
set -euo pipefail

readonly MIN_MAJOR="${DEVLEND_QEMU_MIN_MAJOR:-10}"
# RDMA: the -dev packages and clang for rdma-sys (bindgen) at build time; the rxe
# provider and iproute2's `rdma` for the Soft-RoCE test guest.
# debootstrap: the Debian 13 chroot with QEMU 11 (qemu/build-qemu11-root.sh).
# libvirt and prometheus: tests/tests/libvirt.rs and tests/tests/prometheus.rs.
# binutils: objcopy strips debug info from the binaries put in a test guest's initramfs.
readonly BASE_PACKAGES=(busybox-static cpio binutils kmod iproute2 e2fsprogs xz-utils zstd util-linux postgresql libibverbs-dev librdmacm-dev clang libclang-dev ibverbs-providers rdma-core debootstrap syslinux syslinux-common mtools dosfstools libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients prometheus faketime)
readonly QEMU_PACKAGES=(qemu-system-x86 qemu-utils)
readonly LOCK_FILE=/run/lock/devlend-install-deps.lock

log() { printf 'install-deps: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

check_only=0
case "${1:-}" in
"") ;;
--check) check_only=1 ;;
-h | --help)
	sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
	exit 0
	;;
*) die "unknown argument: $1 (try --help)" ;;
esac

# The Debian codename of this host (bookworm on the machines devlend targets).
codename() {
	local name=""
	if [[ -r /etc/os-release ]]; then
		# shellcheck disable=SC1091
		name="$(. /etc/os-release && printf '%s' "${VERSION_CODENAME:-}")"
	fi
	printf '%s' "${name:-bookworm}"
}

pkg_installed() {
	[[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" == "install ok installed" ]]
}

# Major version of the installed qemu-system-x86_64, or empty.
qemu_major() {
	local line
	command -v qemu-system-x86_64 >/dev/null 2>&1 || return 0
	line="$(qemu-system-x86_64 --version 2>/dev/null | head -n1 || true)"
	# "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)"
	if [[ "$line" =~ version[[:space:]]+([0-9]+)\. ]]; then
		printf '%s' "${BASH_REMATCH[1]}"
	fi
}

# True if an enabled apt source already names SUITE.
has_apt_suite() {
	local suite="$1" f
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[[ -r "$f" ]] || continue
		if grep -Eq "^[[:space:]]*deb[[:space:]].*[[:space:]]${suite}([[:space:]]|$)" "$f"; then
			return 0
		fi
	done
	for f in /etc/apt/sources.list.d/*.sources; do
		[[ -r "$f" ]] || continue
		# deb822: a "Suites:" field naming the suite, in a stanza not disabled.
		if awk -v suite="$suite" '
			BEGIN { RS = ""; FS = "\n"; found = 0 }
			{
				enabled = 1; has = 0
				for (i = 1; i <= NF; i++) {
					if ($i ~ /^[[:space:]]*#/) continue
					if ($i ~ /^Enabled:[[:space:]]*no/) enabled = 0
					if ($i ~ /^Suites:/) {
						n = split($i, w, /[[:space:]]+/)
						for (j = 2; j <= n; j++) if (w[j] == suite) has = 1
					}
				}
				if (enabled && has) found = 1
			}
			END { exit(found ? 0 : 1) }' "$f"; then
			return 0
		fi
	done
	return 1
}

SUITE="$(codename)-backports"
readonly SUITE

# --- What is missing? -------------------------------------------------------
missing_base=()
for p in "${BASE_PACKAGES[@]}"; do
	pkg_installed "$p" || missing_base+=("$p")
done
need_qemu=0
major="$(qemu_major)"
if [[ -z "$major" ]]; then
	log "qemu-system-x86_64 is not installed"
	need_qemu=1
elif ((major < MIN_MAJOR)); then
	log "qemu-system-x86_64 is version ${major}.x, need >= ${MIN_MAJOR}"
	need_qemu=1
fi
for p in "${QEMU_PACKAGES[@]}"; do
	pkg_installed "$p" || need_qemu=1
done
command -v qemu-storage-daemon >/dev/null 2>&1 || need_qemu=1
need_source=0
has_apt_suite "$SUITE" || need_source=1

if ((${#missing_base[@]} == 0 && need_qemu == 0)); then
	log "all present: QEMU $(qemu-system-x86_64 --version | head -n1 | awk '{print $4}'), ${BASE_PACKAGES[*]}"
	exit 0
fi

if ((check_only)); then
	((${#missing_base[@]} == 0)) || log "missing packages: ${missing_base[*]}"
	((need_qemu == 0)) || log "missing: QEMU >= ${MIN_MAJOR} from ${SUITE}"
	((need_source == 0)) || log "missing apt source: ${SUITE}"
	exit 1
fi

[[ "$(id -u)" == 0 ]] || die "must run as root to install packages (missing: ${missing_base[*]} qemu=${need_qemu})"

# Serialise concurrent runs (several test binaries may call this at once).
exec 9>"$LOCK_FILE"
flock 9

export DEBIAN_FRONTEND=noninteractive
readonly APT_OPTS=(-y -q --no-install-recommends -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

# --- apt source for backports (deb822, mirroring debian.sources) ------------
if ((need_source)); then
	src=/etc/apt/sources.list.d/devlend-backports.sources
	log "adding apt source ${SUITE} in ${src}"
	cat >"${src}.tmp" <<EOF
# Added by devlend qemu/install-deps.sh: QEMU 10 for the guest tests.
Types: deb
URIs: http://deb.debian.org/debian
Suites: ${SUITE}
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
	mv "${src}.tmp" "$src"
fi

log "apt-get update"
apt-get update -q

if ((${#missing_base[@]})); then
	log "installing ${missing_base[*]}"
	apt-get install "${APT_OPTS[@]}" "${missing_base[@]}"
fi

if ((need_qemu)); then
	log "installing ${QEMU_PACKAGES[*]} from ${SUITE}"
	apt-get install "${APT_OPTS[@]}" -t "$SUITE" "${QEMU_PACKAGES[@]}"
fi

# --- Verify -----------------------------------------------------------------
major="$(qemu_major)"
[[ -n "$major" ]] || die "qemu-system-x86_64 still missing after install"
((major >= MIN_MAJOR)) || die "qemu-system-x86_64 is ${major}.x after install, need >= ${MIN_MAJOR} (is ${SUITE} reachable?)"
command -v qemu-storage-daemon >/dev/null 2>&1 || die "qemu-storage-daemon missing after install"
for p in "${BASE_PACKAGES[@]}"; do
	pkg_installed "$p" || die "package $p missing after install"
done
log "done: $(qemu-system-x86_64 --version | head -n1)"
