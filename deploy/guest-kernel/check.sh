#!/usr/bin/env bash
# Verify a Cube microVM guest kernel: that the vmlinux is a 64-bit x86 ELF that
# cube-hypervisor can boot through the PVH entry, and that its .config carries
# every option the guest needs.
#
#   check.sh [--fragment FILE] [--config FILE] [VMLINUX]
#
#   VMLINUX          the kernel ELF; its config defaults to VMLINUX.config
#   --config FILE    the kernel .config to verify (alone: config-only check,
#                    which build.sh uses before it spends time compiling)
#   --fragment FILE  requirement list (default: microvm.config next to this script)
#
# Exit status 0 when every check passes, 1 when one fails, 2 on usage errors.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fragment="$here/microvm.config"
config=""
vmlinux=""

# Size bounds for the vmlinux file. A minimal build is ~10-20 MiB; far below
# means a truncated file, far above means a distro-sized config slipped in.
min_bytes=$((2 * 1024 * 1024))
max_bytes=$((128 * 1024 * 1024))

# Options the rest of Cube depends on, checked even if someone trims the
# fragment: the PVH note (boot path), cmdline virtio-mmio (device discovery
# without ACPI), vsock (agent channel), and the absence of ACPI/PCI/modules.
core_required=(
	CONFIG_64BIT=y
	CONFIG_X86_64=y
	CONFIG_PVH=y
	CONFIG_KVM_GUEST=y
	CONFIG_PARAVIRT_CLOCK=y
	CONFIG_VIRTIO_MMIO=y
	CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES=y
	CONFIG_VIRTIO_BLK=y
	CONFIG_VIRTIO_NET=y
	CONFIG_VIRTIO_VSOCKETS=y
	CONFIG_EXT4_FS=y
	CONFIG_OVERLAY_FS=y
	CONFIG_SERIAL_8250_CONSOLE=y
	CONFIG_SERIO_I8042=y
	CONFIG_DEVTMPFS=y
	CONFIG_TMPFS=y
)
core_forbidden=(CONFIG_ACPI CONFIG_PCI CONFIG_MODULES)

usage() {
	sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
	exit 2
}

while [[ $# -gt 0 ]]; do
	case "$1" in
	--fragment) [[ $# -ge 2 ]] || usage; fragment=$2; shift 2 ;;
	--config) [[ $# -ge 2 ]] || usage; config=$2; shift 2 ;;
	-h | --help) usage ;;
	-*) echo "check.sh: unknown option: $1" >&2; usage ;;
	*) [[ -z "$vmlinux" ]] || { echo "check.sh: more than one VMLINUX given" >&2; exit 2; }
	   vmlinux=$1; shift ;;
	esac
done
if [[ -z "$vmlinux" && -z "$config" ]]; then
	echo "check.sh: give a VMLINUX, a --config, or both" >&2
	exit 2
fi
if [[ -n "$vmlinux" && -z "$config" ]]; then
	config="$vmlinux.config"
fi

failures=0
ok() { printf 'ok:   %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; failures=$((failures + 1)); }

for tool in readelf stat; do
	command -v "$tool" >/dev/null || { echo "check.sh: '$tool' not found (install binutils/coreutils)" >&2; exit 2; }
done

# --- .config -------------------------------------------------------------------
# A requirement is either "CONFIG_X=value" (the .config must hold exactly that
# line) or "# CONFIG_X is not set" (the .config must not enable CONFIG_X).
check_required() { # config, "CONFIG_X=v", source label
	local cfg=$1 want=$2 from=$3 name=${2%%=*} have
	if grep -qxF -- "$want" "$cfg"; then
		return 0
	fi
	have=$(grep -E "^$name=|^# $name is not set" "$cfg" || true)
	fail "config: $want required ($from), found: ${have:-absent}"
}
check_forbidden() { # config, CONFIG_X, source label
	local cfg=$1 name=$2 from=$3 have
	have=$(grep -E "^$name=" "$cfg" || true)
	[[ -z "$have" ]] || fail "config: $name must not be set ($from), found: $have"
}

check_config() {
	local cfg=$1 line name n=0 before=$failures
	if [[ ! -r "$cfg" ]]; then
		fail "config: cannot read $cfg"
		return
	fi
	if [[ ! -r "$fragment" ]]; then
		fail "config: cannot read fragment $fragment"
		return
	fi
	while IFS= read -r line || [[ -n "$line" ]]; do
		case "$line" in
		"# CONFIG_"*" is not set")
			name=${line#\# }; name=${name%% *}
			check_forbidden "$cfg" "$name" "fragment"; n=$((n + 1)) ;;
		CONFIG_*=*)
			check_required "$cfg" "$line" "fragment"; n=$((n + 1)) ;;
		"" | "#"*) ;;
		*) fail "fragment: unparsable line: $line" ;;
		esac
	done <"$fragment"
	for line in "${core_required[@]}"; do check_required "$cfg" "$line" "core"; done
	for name in "${core_forbidden[@]}"; do check_forbidden "$cfg" "$name" "core"; done
	if [[ $failures -eq $before ]]; then
		ok "config: all $n fragment options and ${#core_required[@]}+${#core_forbidden[@]} core options as required ($cfg)"
	fi
}

# --- vmlinux ----------------------------------------------------------------------
check_vmlinux() {
	local f=$1 hdr size notes entry_hex entry paddr filesz memsz in_load=0
	if [[ ! -f "$f" ]]; then
		fail "vmlinux: $f does not exist"
		return
	fi
	if ! hdr=$(LC_ALL=C readelf -h "$f" 2>&1); then
		fail "vmlinux: not an ELF file ($hdr)"
		return
	fi
	grep -qE 'Class:[[:space:]]+ELF64' <<<"$hdr" && ok "vmlinux: ELF64" || fail "vmlinux: not ELF64"
	grep -qE 'Machine:[[:space:]]+Advanced Micro Devices X86-64' <<<"$hdr" &&
		ok "vmlinux: machine x86-64" || fail "vmlinux: machine is not x86-64"
	grep -qE 'Type:[[:space:]]+EXEC' <<<"$hdr" && ok "vmlinux: executable (ET_EXEC)" ||
		fail "vmlinux: not an ET_EXEC image"

	size=$(stat -c %s "$f")
	if ((size < min_bytes || size > max_bytes)); then
		fail "vmlinux: size $size bytes outside [$min_bytes, $max_bytes]"
	else
		ok "vmlinux: size $size bytes ($((size / 1024 / 1024)) MiB)"
	fi

	# XEN_ELFNOTE_PHYS32_ENTRY (type 0x12) under owner "Xen": the 32-bit physical
	# entry point of the PVH boot ABI. readelf does not name Xen note types, so
	# match the owner and the raw type, then read the descriptor (little endian).
	notes=$(LC_ALL=C readelf -nW "$f" 2>/dev/null || true)
	local desc
	# binutils prints the descriptor on the same line ("... (0x00000012)
	# description data: bc 0a ..."); older ones on the next line.
	desc=$(awk '
		$1 == "Xen" && $0 ~ /(0x00000012|XEN_ELFNOTE_PHYS32_ENTRY)/ { grab = 1 }
		grab && /description data:/ { sub(/.*description data:[[:space:]]*/, ""); print; exit }
		grab && $1 != "Xen" && NF { grab = 0 }
	' <<<"$notes")
	if [[ -z "$desc" ]]; then
		fail "vmlinux: no Xen note of type 0x12 (XEN_ELFNOTE_PHYS32_ENTRY); is CONFIG_PVH=y?"
		return
	fi
	# Bytes are printed lowest address first; reverse them into a number.
	entry_hex=$(tr -s ' ' '\n' <<<"$desc" | grep -E '^[0-9a-f]{2}$' | tac | tr -d '\n')
	if [[ -z "$entry_hex" ]]; then
		fail "vmlinux: PVH note has no descriptor"
		return
	fi
	entry=$((16#$entry_hex))
	if ((entry == 0 || entry >= 0x100000000)); then
		fail "vmlinux: PVH entry $(printf '0x%x' "$entry") is not a 32-bit physical address"
		return
	fi
	# The entry must fall inside a PT_LOAD segment's physical range, or the
	# loader would jump into memory it never filled.
	while read -r paddr filesz memsz; do
		if ((entry >= paddr && entry < paddr + memsz)); then in_load=1; fi
	done < <(LC_ALL=C readelf -lW "$f" | awk '$1 == "LOAD" { print $4, $5, $6 }')
	if ((in_load)); then
		ok "vmlinux: PVH note XEN_ELFNOTE_PHYS32_ENTRY (Xen, 0x12), entry $(printf '0x%x' "$entry") inside a PT_LOAD segment"
	else
		fail "vmlinux: PVH entry $(printf '0x%x' "$entry") is outside every PT_LOAD segment"
	fi
}

[[ -z "$vmlinux" ]] || check_vmlinux "$vmlinux"
check_config "$config"

if ((failures)); then
	echo "check.sh: $failures check(s) FAILED"
	exit 1
fi
echo "check.sh: all checks passed"
