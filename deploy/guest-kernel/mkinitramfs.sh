#!/usr/bin/env bash
# Make a tiny initramfs for smoke-booting the guest kernel: a static busybox
# (Debian's busybox-static) and an /init that mounts the pseudo filesystems,
# prints a marker line with what the kernel found, and stops the machine.
#
#   mkinitramfs.sh [--out FILE] [--marker TEXT] [--busybox PATH] [--stop reboot|poweroff]
#
#   --out FILE      output cpio (newc), gzip-compressed (default: out/initramfs.cpio.gz
#                   next to this script)
#   --marker TEXT   first word of the line /init prints (default: CUBE_GUEST_INIT_OK)
#   --busybox PATH  static busybox to use (default: /bin/busybox from busybox-static)
#   --stop HOW      reboot (default): reset through the i8042; poweroff: `poweroff -f`,
#                   which without ACPI leaves every vCPU halted with interrupts off
#                   (what a VMM must notice as the guest stopping)
#
# /init stops the VM with `reboot -f`: a microVM has no ACPI to power off
# through, so with `reboot=k` the kernel resets through the i8042 controller,
# which cube-hypervisor (like Firecracker) and `qemu -no-reboot` treat as the
# guest shutting down.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out="$here/out/initramfs.cpio.gz"
marker=CUBE_GUEST_INIT_OK
busybox=/bin/busybox
stop=reboot

die() { echo "mkinitramfs.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }

while [[ $# -gt 0 ]]; do
	case "$1" in
	--out) [[ $# -ge 2 ]] || usage; out=$2; shift 2 ;;
	--marker) [[ $# -ge 2 ]] || usage; marker=$2; shift 2 ;;
	--stop) [[ $# -ge 2 ]] || usage; stop=$2; shift 2 ;;
	--busybox) [[ $# -ge 2 ]] || usage; busybox=$2; shift 2 ;;
	-h | --help) usage ;;
	*) echo "mkinitramfs.sh: unknown argument: $1" >&2; usage ;;
	esac
done
[[ "$stop" == reboot || "$stop" == poweroff ]] || die "--stop must be reboot or poweroff, got '$stop'"
[[ "$marker" =~ ^[A-Za-z0-9_.:-]+$ ]] || die "--marker must be one word of [A-Za-z0-9_.:-], got '$marker'"

# The default busybox comes from busybox-static (Debian's plain busybox
# package is dynamically linked and also installs /bin/busybox).
if [[ "$busybox" == /bin/busybox ]] &&
	[[ "$(dpkg-query -W -f='${Status}' busybox-static 2>/dev/null)" != "install ok installed" ]]; then
	[[ $(id -u) -eq 0 ]] || die "busybox-static is not installed (apt-get install busybox-static)"
	echo "mkinitramfs.sh: installing busybox-static" >&2
	export DEBIAN_FRONTEND=noninteractive
	apt-get install -y -q --no-install-recommends busybox-static >&2 ||
		{ apt-get update -q >&2 && apt-get install -y -q --no-install-recommends busybox-static >&2; } ||
		die "apt-get install busybox-static failed"
fi
for tool in cpio gzip readelf; do
	command -v "$tool" >/dev/null || die "'$tool' not found"
done
[[ -x "$busybox" ]] || die "busybox $busybox not found"
# A dynamic busybox would need a libc in the initramfs; refuse it early.
if LC_ALL=C readelf -lW "$busybox" | grep -q 'Requesting program interpreter'; then
	die "$busybox is dynamically linked; install busybox-static"
fi

stage=$(mktemp -d "${TMPDIR:-/tmp}/cube-initramfs.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,sbin,dev,proc,sys,tmp,run,etc,root}
cp "$busybox" "$stage/bin/busybox"
for applet in sh mount umount echo cat ls uname sleep sync reboot poweroff dmesg ip grep; do
	ln -s busybox "$stage/bin/$applet"
done
# The kernel opens /dev/console for init's stdio before /init can mount
# devtmpfs; the built-in initramfs provides it too, but do not rely on that.
if [[ $(id -u) -eq 0 ]]; then
	mknod -m 600 "$stage/dev/console" c 5 1
	mknod -m 666 "$stage/dev/null" c 1 3
fi

cat >"$stage/init" <<EOF
#!/bin/sh
# Cube guest-kernel smoke init: report what the kernel sees, then stop.
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
ncpu=\$(grep -c '^processor' /proc/cpuinfo)
nvirtio=\$(ls /sys/bus/virtio/devices 2>/dev/null | wc -l)
clock=\$(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)
echo "$marker kernel=\$(uname -r) cpus=\$ncpu virtio_devices=\$nvirtio clocksource=\$clock"
for d in /sys/bus/virtio/devices/*; do
	[ -e "\$d/device" ] && echo "virtio: \${d##*/} device-id=\$(cat \$d/device)"
done
sync
# No ACPI: "power off" = reset through the i8042 (kernel parameter reboot=k) unless the
# test wants the halt path (--stop poweroff).
$stop -f
# Only reached if the stop did not stop the VM.
echo "$marker: $stop -f returned; halting" >&2
exec sleep 2147483647
EOF
chmod 755 "$stage/init"

mkdir -p "$(dirname "$out")"
(cd "$stage" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) | gzip -9 -n >"$out.tmp.$$"
mv -f "$out.tmp.$$" "$out"
echo "mkinitramfs.sh: $out ($(stat -c %s "$out") bytes, marker $marker)"
