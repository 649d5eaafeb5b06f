#!/usr/bin/env bash
# Build devlend's test guest: a Debian kernel and a small busybox initramfs.
#
# Output, in ${DEVLEND_GUEST_DIR:-/var/cache/devlend/guest}:
#   vmlinuz         the kernel of Debian's current linux-image-amd64 (bzImage)
#   vmlinux         the same kernel uncompressed (an ELF with a PVH entry
#                   point), when it can be extracted; QEMU boots it directly,
#                   which skips ~7 s of in-guest XZ decompression under TCG
#   initrd.gz       the base initramfs (gzip'd newc cpio): busybox, /init,
#                   helpers and the kernel modules the tests need
#   KERNEL_VERSION  the kernel release (`uname -r` in the guest)
#   BUILD_ID        package, package version and a hash of this script; the
#                   build is skipped when it matches (a fast no-op)
#   modules.txt     which modules are in the initramfs, built in, or missing
#   deb/            the downloaded kernel package (kept for rebuilds)
#
# A per-test cpio archive holding /test.sh (and any other files) is appended
# to initrd.gz by the test harness; the kernel unpacks concatenated archives
# in order. See qemu/README.md for the guest's /init contract.
#
# Usage: qemu/build-guest.sh [--force]
#   --force   rebuild even when the cache is up to date
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly here
readonly DIR="${DEVLEND_GUEST_DIR:-/var/cache/devlend/guest}"

# Loaded by /init at every boot; a missing one is an error.
readonly REQUIRED_MODULES=(
	virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci
	virtio_blk failover net_failover virtio_net
)
# Shipped for RDMA (Soft-RoCE) and VFIO tests and loaded on demand with
# `devlend-modprobe NAME` or the `devlend.modules=a,b` kernel argument; a
# missing one is a warning.
readonly OPTIONAL_MODULES=(
	crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe
	iw_cm ib_cm configfs rdma_cm rdma_ucm
	vfio vfio_iommu_type1 vfio_virqfd irqbypass vfio-pci-core vfio-pci
	dummy
)
# Load-order needs that modinfo does not record (runtime lookups): rdma_rxe
# finds its CRC32 through the crypto API, and without crc32_generic loaded
# first `rdma link add` fails with "failed to add".
declare -A EXTRA_PRE=([rdma_rxe]=crc32_generic)

log() { printf 'build-guest: %s\n' "$*" >&2; }
warn() { printf 'build-guest: warning: %s\n' "$*" >&2; }
die() {
	printf 'build-guest: error: %s\n' "$*" >&2
	exit 1
}

force=0
case "${1:-}" in
"") ;;
--force) force=1 ;;
-h | --help)
	sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
	exit 0
	;;
*) die "unknown argument: $1 (try --help)" ;;
esac

# The tools below (and QEMU for the tests); a fast check when all present.
"$here/install-deps.sh"

mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock 9

# --- Which kernel? ----------------------------------------------------------
script_hash="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"

have_cache() {
	[[ -s "$DIR/vmlinuz" && -s "$DIR/initrd.gz" && -s "$DIR/KERNEL_VERSION" && -s "$DIR/BUILD_ID" ]]
}

# Fast path: the cache was built by this very script and apt's lists and
# configuration have not changed since, so apt would resolve the same kernel.
# (apt-cache takes about a second per call on this machine: no binary cache.)
if ((!force)) && have_cache &&
	[[ "$(awk '{ print $3 }' "$DIR/BUILD_ID")" == "$script_hash" ]] &&
	[[ -z "$(find /var/lib/apt/lists /etc/apt -newer "$DIR/BUILD_ID" -print -quit 2>/dev/null)" ]]; then
	log "up to date: $DIR (kernel $(cat "$DIR/KERNEL_VERSION"); apt lists unchanged)"
	exit 0
fi

# Prints "<package> <version>": the kernel package linux-image-amd64 depends on
# (its name changes with Debian's ABI bumps, so it is looked up every time).
resolve_kernel_package() {
	apt-cache show --no-all-versions linux-image-amd64 2>/dev/null | awk '
		$1 == "Depends:" {
			sub(/^Depends:[[:space:]]*/, "")
			n = split($0, alts, /,[[:space:]]*/)
			for (i = 1; i <= n; i++) {
				if (match(alts[i], /^linux-image-[0-9][^ ]*-amd64/)) {
					name = substr(alts[i], RSTART, RLENGTH)
					ver = ""
					if (match(alts[i], /\(= [^)]+\)/)) ver = substr(alts[i], RSTART + 3, RLENGTH - 4)
					print name, ver
					exit
				}
			}
		}'
}

resolved="$(resolve_kernel_package || true)"
if [[ -z "$resolved" && "$(id -u)" == 0 ]]; then
	log "apt lists do not know linux-image-amd64; running apt-get update"
	apt-get update -q >&2 || warn "apt-get update failed"
	resolved="$(resolve_kernel_package || true)"
fi
if [[ -z "$resolved" ]]; then
	if have_cache; then
		warn "cannot resolve linux-image-amd64; using the cached guest ($(cat "$DIR/KERNEL_VERSION"))"
		exit 0
	fi
	die "cannot resolve linux-image-amd64 with apt-cache (run apt-get update?)"
fi
read -r pkg pkgver <<<"$resolved"
if [[ -z "$pkgver" ]]; then
	pkgver="$(apt-cache show --no-all-versions "$pkg" 2>/dev/null | awk '$1 == "Version:" { print $2; exit }')"
fi
[[ -n "$pkgver" ]] || die "apt-cache knows no version of $pkg"
kver="${pkg#linux-image-}"
build_id="$pkg $pkgver $script_hash"

if ((!force)) && have_cache &&
	[[ "$(cat "$DIR/KERNEL_VERSION")" == "$kver" && "$(cat "$DIR/BUILD_ID")" == "$build_id" ]]; then
	touch "$DIR/BUILD_ID"
	log "up to date: $DIR (kernel $kver)"
	exit 0
fi

log "building guest for kernel $kver ($pkg $pkgver) in $DIR"
work="$(mktemp -d "$DIR/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# --- Fetch and unpack the kernel package -------------------------------------
mkdir -p "$DIR/deb"
deb=""
while IFS= read -r -d '' f; do
	if [[ "$(dpkg-deb -f "$f" Version 2>/dev/null)" == "$pkgver" ]]; then
		deb="$f"
		break
	fi
done < <(find "$DIR/deb" -maxdepth 1 -name "${pkg}_*.deb" -print0)
if [[ -z "$deb" ]]; then
	log "downloading $pkg=$pkgver"
	(cd "$work" && apt-get download -q -o APT::Sandbox::User=root "$pkg=$pkgver" >&2)
	deb="$(find "$work" -maxdepth 1 -name "${pkg}_*.deb" | head -n1)"
	[[ -n "$deb" ]] || die "apt-get download $pkg produced no .deb"
	find "$DIR/deb" -maxdepth 1 -name '*.deb' -delete
	mv "$deb" "$DIR/deb/"
	deb="$DIR/deb/$(basename "$deb")"
fi
log "unpacking $(basename "$deb")"
dpkg-deb -x "$deb" "$work/pkg"

vmlinuz="$work/pkg/boot/vmlinuz-$kver"
config="$work/pkg/boot/config-$kver"
[[ -f "$vmlinuz" ]] || die "no boot/vmlinuz-$kver in $pkg"
moddir=""
for d in "$work/pkg/lib/modules/$kver" "$work/pkg/usr/lib/modules/$kver"; do
	if [[ -d "$d" ]]; then
		moddir="$d"
		break
	fi
done
[[ -n "$moddir" ]] || die "no lib/modules/$kver in $pkg"

# PCIe native hotplug is how the guest notices a device plugged into a
# pcie-root-port; it is a bool option, so it must be built in.
if [[ -f "$config" ]]; then
	for opt in CONFIG_HOTPLUG_PCI_PCIE CONFIG_PCIEPORTBUS CONFIG_DEVTMPFS CONFIG_RD_GZIP; do
		if grep -q "^${opt}=y" "$config"; then
			log "$opt=y"
		else
			warn "$opt is not built in: $(grep -E "^#? ?${opt}[= ]" "$config" || echo unset)"
		fi
	done
else
	warn "no boot/config-$kver in $pkg; cannot check for pciehp"
fi

# --- An uncompressed, PVH-bootable kernel ------------------------------------
# The bzImage decompresses itself inside the guest; under TCG that takes ~7 s
# for Debian's XZ payload. With CONFIG_PVH=y the payload (an ELF vmlinux with
# a PVH entry note) can be given to QEMU's -kernel as is. The payload's place
# is in the bzImage setup header (Documentation/x86/boot.rst): setup_sects at
# 0x1f1, payload_offset at 0x248 and payload_length at 0x24c.
header_uint() { # file offset bytes
	od -An -t"u$3" -j "$2" -N "$3" "$1" | tr -d ' '
}
extract_vmlinux() { # bzImage out
	local img="$1" out="$2" setup_sects off len start magic
	setup_sects="$(header_uint "$img" $((0x1f1)) 1)"
	((setup_sects != 0)) || setup_sects=4
	off="$(header_uint "$img" $((0x248)) 4)"
	len="$(header_uint "$img" $((0x24c)) 4)"
	[[ -n "$off" && -n "$len" ]] && ((len > 4)) || return 1
	start=$(((setup_sects + 1) * 512 + off))
	magic="$(tail -c +$((start + 1)) "$img" | head -c 6 | od -An -tx1 | tr -d ' \n')"
	case "$magic" in
	fd377a585a00) tail -c +$((start + 1)) "$img" | head -c "$len" | xz -dc --single-stream >"$out" ;;
	28b52ffd*) tail -c +$((start + 1)) "$img" | head -c $((len - 4)) | zstd -q -dc >"$out" ;;
	1f8b*) tail -c +$((start + 1)) "$img" | head -c "$len" | gzip -dcq >"$out" || [[ $? == 2 ]] ;;
	*)
		warn "unknown kernel payload compression (magic $magic)"
		return 1
		;;
	esac
	[[ "$(head -c 4 "$out" | od -An -tx1 | tr -d ' \n')" == 7f454c46 ]]
}
have_vmlinux=0
if [[ -f "$config" ]] && grep -q '^CONFIG_PVH=y' "$config"; then
	if extract_vmlinux "$vmlinuz" "$work/vmlinux" 2>/dev/null; then
		have_vmlinux=1
		log "extracted the uncompressed kernel for PVH boot ($(du -h "$work/vmlinux" | cut -f1))"
	else
		warn "could not extract vmlinux from the bzImage; the harness will boot vmlinuz (slower)"
	fi
else
	warn "kernel lacks CONFIG_PVH=y; the harness will boot vmlinuz (slower)"
fi

# --- Module index -------------------------------------------------------------
norm() { printf '%s' "${1//-/_}"; }

declare -A mod_file=() # normalised name -> path relative to $moddir (maybe compressed)
declare -A builtin=()  # normalised name -> 1
while IFS= read -r -d '' f; do
	rel="${f#"$moddir"/}"
	base="${rel##*/}"
	base="${base%%.ko*}"
	mod_file["${base//-/_}"]="$rel"
done < <(find "$moddir/kernel" -type f \( -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz' \) -print0)
if [[ -f "$moddir/modules.builtin" ]]; then
	while IFS= read -r line; do
		base="${line##*/}"
		base="${base%.ko}"
		builtin["${base//-/_}"]=1
	done <"$moddir/modules.builtin"
fi
log "kernel package has ${#mod_file[@]} loadable modules, ${#builtin[@]} built in"

root="$work/root"
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,run,etc/devlend,root,mnt}
chmod 1777 "$root/tmp"
kmods="$root/lib/modules/$kver"
mkdir -p "$kmods"

declare -A staged=() # normalised name -> path of the .ko in the initramfs (relative to $kmods)

# Copy one module into the initramfs, uncompressed (busybox insmod reads plain
# .ko files only). Prints its path relative to /lib/modules/<ver>.
stage_module() {
	local n="$1" rel out
	rel="${mod_file[$n]}"
	case "$rel" in
	*.ko) out="$rel" ;;
	*.ko.xz) out="${rel%.xz}" ;;
	*.ko.zst) out="${rel%.zst}" ;;
	*.ko.gz) out="${rel%.gz}" ;;
	*) die "unexpected module file $rel" ;;
	esac
	mkdir -p "$(dirname "$kmods/$out")"
	case "$rel" in
	*.ko) cp "$moddir/$rel" "$kmods/$out" ;;
	*.ko.xz) xz -dc "$moddir/$rel" >"$kmods/$out" ;;
	*.ko.zst) zstd -q -dc "$moddir/$rel" >"$kmods/$out" ;;
	*.ko.gz) gzip -dc "$moddir/$rel" >"$kmods/$out" ;;
	esac
	staged["$n"]="$out"
}

# Module names of one modinfo field ("depends" is comma-separated, "softdep"
# is "pre: a b post: c"). Prints one name per line.
mod_depends() {
	modinfo -F depends "$kmods/${staged[$1]}" | tr ',' '\n' | sed '/^$/d'
}
mod_softdeps() { # $1 = name, $2 = pre|post
	modinfo -F softdep "$kmods/${staged[$1]}" | awk -v want="$2:" '
		{ for (i = 1; i <= NF; i++) { if ($i ~ /:$/) cur = $i; else if (cur == want) print $i } }'
}

# True if NAME is built in or shipped as a module file.
available() {
	local n
	n="$(norm "$1")"
	[[ -n "${builtin[$n]:-}" || -n "${mod_file[$n]:-}" ]]
}

# Append to $chain the modules NAME needs, in load order, then NAME itself.
# NAME must be available; its hard dependencies must be too (else the
# build fails); soft ones are taken when available.
declare -a chain=()
declare -A in_chain=()
declare -A visiting=()
add_chain() {
	local n d deps pre post
	n="$(norm "$1")"
	[[ -z "${in_chain[$n]:-}" ]] || return 0
	if [[ -n "${builtin[$n]:-}" ]]; then
		in_chain["$n"]=builtin
		return 0
	fi
	[[ -n "${mod_file[$n]:-}" ]] || die "module $n is needed but $pkg does not have it"
	[[ -z "${visiting[$n]:-}" ]] || die "module dependency cycle at $n"
	visiting["$n"]=1
	[[ -n "${staged[$n]:-}" ]] || stage_module "$n"
	deps="$(mod_depends "$n")"
	pre="${EXTRA_PRE[$n]:-} $(mod_softdeps "$n" pre)"
	post="$(mod_softdeps "$n" post)"
	for d in $pre; do
		if available "$d"; then add_chain "$d"; fi
	done
	for d in $deps; do
		add_chain "$d"
	done
	unset 'visiting[$n]'
	in_chain["$n"]=1
	chain+=("${staged[$n]}")
	for d in $post; do
		# A post-softdep may depend on NAME itself (vfio -> vfio_iommu_type1).
		if available "$d" && [[ -z "${visiting[$(norm "$d")]:-}" ]]; then add_chain "$d"; fi
	done
	return 0
}

# For each module: the ordered .ko list that loads it. One line per module:
# "<name> <path>..." (no paths: built in), read by devlend-modprobe.
modlist="$kmods/devlend.modules"
: >"$modlist"
report="$work/modules.txt"
{
	echo "# devlend guest modules for kernel $kver ($pkg $pkgver)"
	echo "# name: state [load order]"
} >"$report"
boot_chain=()
declare -A in_boot=()
for m in "${REQUIRED_MODULES[@]}" "${OPTIONAL_MODULES[@]}"; do
	n="$(norm "$m")"
	chain=()
	in_chain=()
	if [[ -n "${builtin[$n]:-}" ]]; then
		printf '%s\n' "$n" >>"$modlist"
		echo "$n: built in" >>"$report"
		continue
	fi
	if ! available "$n"; then
		if [[ " ${REQUIRED_MODULES[*]} " == *" $m "* ]]; then
			die "required module $m is neither built in nor in $pkg"
		fi
		warn "optional module $m is not in $pkg; skipped"
		echo "$n: missing" >>"$report"
		continue
	fi
	add_chain "$n"
	printf '%s %s\n' "$n" "${chain[*]}" >>"$modlist"
	echo "$n: module ${chain[*]}" >>"$report"
	if [[ " ${REQUIRED_MODULES[*]} " == *" $m "* ]]; then
		for p in "${chain[@]}"; do
			if [[ -z "${in_boot[$p]:-}" ]]; then
				in_boot["$p"]=1
				boot_chain+=("$p")
			fi
		done
	fi
done
printf '%s\n' "${boot_chain[@]}" >"$root/etc/devlend/boot-modules"
log "boot modules: ${boot_chain[*]##*/}"
log "staged ${#staged[@]} modules ($(du -sh "$kmods" | cut -f1))"

# --- busybox ----------------------------------------------------------------
busybox="$(command -v busybox || true)"
[[ -n "$busybox" ]] || die "busybox not found (install busybox-static)"
if ldd "$busybox" >/dev/null 2>&1; then
	die "$busybox is dynamically linked; install busybox-static"
fi
cp "$busybox" "$root/bin/busybox"
while IFS= read -r applet; do
	case "$applet" in
	"" | linuxrc | bin/busybox) continue ;;
	esac
	[[ -e "$root/$applet" || -L "$root/$applet" ]] && continue
	mkdir -p "$(dirname "$root/$applet")"
	ln -s /bin/busybox "$root/$applet"
done < <("$root/bin/busybox" --list-full)

# The kernel's own built-in initramfs has /dev/console already; add it anyway
# when we can (needs root), so init always has a console.
mknod -m 600 "$root/dev/console" c 5 1 2>/dev/null || true

# --- /init and helpers -----------------------------------------------------------
cat >"$root/init" <<'EOF'
#!/bin/sh
# devlend test guest init (generated by qemu/build-guest.sh).
# Runs /test.sh if present, then prints "DEVLEND-DONE rc=<its exit code>" and
# powers off. Kernel arguments: devlend.modules=a,b (load at boot),
# devlend.shell=1 (interactive shell on the console before powering off).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
cd /
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
ip link set lo up 2>/dev/null
kver="$(uname -r)"
while read -r m; do
	insmod "/lib/modules/$kver/$m" || echo "devlend-init: insmod $m failed"
done </etc/devlend/boot-modules
shell=0
read -r cmdline </proc/cmdline
for arg in $cmdline; do
	case "$arg" in
	devlend.modules=*)
		mods="$(echo "${arg#devlend.modules=}" | tr ',' ' ')"
		# shellcheck disable=SC2086 # one argument per module
		devlend-modprobe $mods
		;;
	devlend.shell=1) shell=1 ;;
	esac
done
echo "DEVLEND-READY uptime=$(cut -d' ' -f1 /proc/uptime)"
rc=0
if [ -f /test.sh ]; then
	sh /test.sh </dev/null
	rc=$?
else
	echo "devlend-init: no /test.sh"
fi
sync
echo "DEVLEND-DONE rc=$rc"
if [ "$shell" = 1 ]; then
	setsid cttyhack sh
fi
# Let the serial line drain before the power goes.
sleep 0.2
poweroff -f
EOF
chmod 755 "$root/init"

cat >"$root/bin/devlend-modprobe" <<'EOF'
#!/bin/sh
# devlend-modprobe NAME...: load kernel modules shipped in the guest
# initramfs, dependencies first (as resolved by qemu/build-guest.sh).
list="/lib/modules/$(uname -r)/devlend.modules"
rc=0
for want in "$@"; do
	want="$(echo "$want" | tr '-' '_')"
	line="$(grep "^$want\( \|\$\)" "$list")"
	if [ -z "$line" ]; then
		echo "devlend-modprobe: $want is not in this initramfs" >&2
		rc=1
		continue
	fi
	for p in ${line#"$want"}; do
		name="$(basename "$p" .ko | tr '-' '_')"
		[ -e "/sys/module/$name/initstate" ] && continue
		insmod "/lib/modules/$(uname -r)/$p" || { echo "devlend-modprobe: insmod $p failed" >&2; rc=1; }
	done
done
exit $rc
EOF
chmod 755 "$root/bin/devlend-modprobe"

cat >"$root/bin/devlend-wait-for" <<'EOF'
#!/bin/sh
# devlend-wait-for PATH [TIMEOUT_SECONDS]: wait until PATH exists (a device
# the host hot-plugs, say). Prints "DEVLEND-WAIT path=PATH" first, so the host
# knows the guest is waiting, then "DEVLEND-WAITED path=PATH"; exits 1 after
# TIMEOUT_SECONDS (default 60).
path="$1"
timeout="${2:-60}"
echo "DEVLEND-WAIT path=$path"
i=0
while [ ! -e "$path" ]; do
	if [ "$i" -ge "$((timeout * 10))" ]; then
		echo "devlend-wait-for: $path did not appear within ${timeout}s" >&2
		exit 1
	fi
	sleep 0.1
	i=$((i + 1))
done
echo "DEVLEND-WAITED path=$path"
EOF
chmod 755 "$root/bin/devlend-wait-for"

echo "$kver" >"$root/etc/devlend/kernel-version"

# --- Pack and install -------------------------------------------------------------
log "packing initramfs"
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) | gzip -6 -n >"$work/initrd.gz"

cp "$vmlinuz" "$DIR/vmlinuz.tmp"
mv "$DIR/vmlinuz.tmp" "$DIR/vmlinuz"
if ((have_vmlinux)); then
	mv "$work/vmlinux" "$DIR/vmlinux"
else
	rm -f "$DIR/vmlinux"
fi
mv "$work/initrd.gz" "$DIR/initrd.gz"
mv "$report" "$DIR/modules.txt"
echo "$kver" >"$DIR/KERNEL_VERSION"
echo "$build_id" >"$DIR/BUILD_ID"
log "done: $DIR/vmlinuz ($(du -h "$DIR/vmlinuz" | cut -f1)), $DIR/initrd.gz ($(du -h "$DIR/initrd.gz" | cut -f1)), kernel $kver"
