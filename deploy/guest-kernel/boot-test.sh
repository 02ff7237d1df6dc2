#!/usr/bin/env bash
# Smoke-boot the guest kernel in QEMU's `microvm` machine (PVH entry, no ACPI,
# virtio-mmio devices passed on the kernel command line) with the initramfs from
# mkinitramfs.sh, and check that /init ran and saw the virtio devices.
#
#   boot-test.sh [--vmlinux FILE] [--initramfs FILE] [--accel kvm|tcg] [--timeout S]
#
#   --vmlinux FILE    default: out/vmlinux next to this script
#   --initramfs FILE  default: out/initramfs.cpio.gz (made by mkinitramfs.sh if missing)
#   --accel A         kvm on hosts with hardware virtualization (VMX/SVM), else tcg.
#                     PVM-only hosts (no vmx/svm flag) cannot run this kernel under
#                     kvm: its kernel mode is emulated ~3000x slower and never reaches init.
#   --timeout S       give up after S seconds (default 180)
#
# Needs qemu-system-x86 (apt-get install --no-install-recommends qemu-system-x86).
# Exit status 0 when the marker line and the expected virtio devices were seen.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
vmlinux="$here/out/vmlinux"
initramfs="$here/out/initramfs.cpio.gz"
accel=""
timeout_s=180
marker=CUBE_GUEST_INIT_OK

die() { echo "boot-test.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }

while [[ $# -gt 0 ]]; do
	case "$1" in
	--vmlinux) [[ $# -ge 2 ]] || usage; vmlinux=$2; shift 2 ;;
	--initramfs) [[ $# -ge 2 ]] || usage; initramfs=$2; shift 2 ;;
	--accel) [[ $# -ge 2 ]] || usage; accel=$2; shift 2 ;;
	--timeout) [[ $# -ge 2 ]] || usage; timeout_s=$2; shift 2 ;;
	-h | --help) usage ;;
	*) echo "boot-test.sh: unknown argument: $1" >&2; usage ;;
	esac
done
[[ "$timeout_s" =~ ^[1-9][0-9]*$ ]] || die "--timeout wants a positive integer"
command -v qemu-system-x86_64 >/dev/null ||
	die "qemu-system-x86_64 not found (apt-get install --no-install-recommends qemu-system-x86)"
[[ -f "$vmlinux" ]] || die "$vmlinux not found (run build.sh first)"
if [[ ! -f "$initramfs" ]]; then
	"$here/mkinitramfs.sh" --out "$initramfs" --marker "$marker" >&2
fi

hw_virt=0
grep -qwE 'vmx|svm' /proc/cpuinfo && [[ -w /dev/kvm ]] && hw_virt=1
if [[ -z "$accel" ]]; then
	if ((hw_virt)); then accel=kvm; else accel=tcg; fi
fi
case "$accel" in
kvm)
	((hw_virt)) || echo "boot-test.sh: warning: no vmx/svm CPU flag; /dev/kvm here is not hardware KVM (PVM?) and this guest will not reach init" >&2
	cpu=host ;;
tcg) cpu=max ;;
*) die "--accel must be kvm or tcg" ;;
esac

work=$(mktemp -d "${TMPDIR:-/tmp}/cube-boot-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
truncate -s 16M "$work/disk.img"

# The cmdline Cube's VMM uses (minus root=, since we boot an initramfs).
# QEMU's microvm appends one virtio_mmio.device=... per device itself
# (auto-kernel-cmdline), which exercises CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES.
append="console=ttyS0 reboot=k panic=-1 pci=off nomodule i8042.noaux i8042.nomux i8042.dumbkbd swiotlb=noforce rdinit=/init"
[[ "$accel" == kvm ]] && append+=" clocksource=kvm-clock"

start=$(date +%s.%N)
set +e
timeout --kill-after=5 "$timeout_s" qemu-system-x86_64 \
	-M microvm,acpi=off,rtc=off -accel "$accel" -cpu "$cpu" -smp 2 -m 256 \
	-nodefaults -no-user-config -nographic -no-reboot \
	-serial "file:$work/console.log" -monitor none \
	-kernel "$vmlinux" -initrd "$initramfs" -append "$append" \
	-drive "id=d0,file=$work/disk.img,format=raw,if=none" -device virtio-blk-device,drive=d0 \
	-netdev user,id=n0,restrict=on -device virtio-net-device,netdev=n0 \
	-device virtio-rng-device \
	>"$work/qemu.log" 2>&1
rc=$?
set -e
elapsed=$(echo "$(date +%s.%N) - $start" | bc)

echo "--- guest console (last 40 lines)"
tail -n 40 "$work/console.log" || true
echo "---"
[[ -s "$work/qemu.log" ]] && { echo "--- qemu"; cat "$work/qemu.log"; echo "---"; }

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
if ((rc == 124 || rc == 137)); then
	fail "the VM did not stop within ${timeout_s}s"
elif ((rc != 0)); then
	fail "qemu exited with status $rc"
fi
line=$(grep -a "^$marker " "$work/console.log" | head -n1 || true)
if [[ -z "$line" ]]; then
	fail "marker '$marker' not printed: /init did not run"
else
	echo "ok:   init ran: $line"
	# virtio device ids: 1 net, 2 block, 4 entropy.
	for id in 0x0001 0x0002 0x0004; do
		grep -aq "device-id=$id" "$work/console.log" && echo "ok:   virtio device $id probed" ||
			fail "virtio device $id not seen by the guest"
	done
fi
grep -aq 'reboot: Restarting system' "$work/console.log" &&
	echo "ok:   guest stopped through reboot=k" || fail "guest did not reach the i8042 reset"
printf 'boot-test.sh: accel=%s elapsed=%.1fs (boot to marker and reset)\n' "$accel" "$elapsed"
((failures == 0)) || { echo "boot-test.sh: $failures check(s) FAILED"; exit 1; }
echo "boot-test.sh: all checks passed"
