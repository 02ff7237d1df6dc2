#!/usr/bin/env bash
# Tests for the guest-kernel scripts that need no kernel build (seconds):
# check.sh must reject what cube-hypervisor could not boot or what lacks a
# required option; build.sh's cache key must follow its inputs and a cached
# entry must be reused without building.
#
#   selftest.sh [VMLINUX]
#
# With VMLINUX (and VMLINUX.config next to it, as build.sh writes them) the
# positive checks and the damaged-copy cases run on a real kernel too.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
vmlinux=${1:-}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cube-gk-selftest.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

passed=0
failed=0
pass() { echo "PASS: $*"; passed=$((passed + 1)); }
flunk() { echo "FAIL: $*"; failed=$((failed + 1)); }

# expect_fail NAME PATTERN CMD...: CMD must exit 1 and print PATTERN.
expect_fail() {
	local name=$1 pattern=$2 rc=0 output
	shift 2
	output=$("$@" 2>&1) || rc=$?
	if [[ $rc -ne 1 ]]; then
		flunk "$name: expected exit 1, got $rc"; echo "$output" | sed 's/^/    /'
	elif ! grep -qE -- "$pattern" <<<"$output"; then
		flunk "$name: output lacks /$pattern/"; echo "$output" | sed 's/^/    /'
	else
		pass "$name"
	fi
}
expect_ok() {
	local name=$1 rc=0 output
	shift
	output=$("$@" 2>&1) || rc=$?
	if [[ $rc -eq 0 ]]; then pass "$name"; else flunk "$name: exit $rc"; echo "$output" | sed 's/^/    /'; fi
}

# A .config that satisfies the fragment exactly: its "=" lines plus nothing else.
good_config="$tmp/good.config"
grep -E '^CONFIG_' "$here/microvm.config" >"$good_config"
expect_ok "config made of the fragment's own lines passes" "$here/check.sh" --config "$good_config"

sed '/^CONFIG_PVH=y$/d' "$good_config" >"$tmp/no-pvh.config"
expect_fail "missing CONFIG_PVH is reported" 'CONFIG_PVH=y required' \
	"$here/check.sh" --config "$tmp/no-pvh.config"

# Kconfig silently turning an option into a module or another value is caught.
sed 's/^CONFIG_VIRTIO_VSOCKETS=y$/CONFIG_VIRTIO_VSOCKETS=m/' "$good_config" >"$tmp/vsock-m.config"
expect_fail "option demoted to =m is reported" 'CONFIG_VIRTIO_VSOCKETS=y required.*found: CONFIG_VIRTIO_VSOCKETS=m' \
	"$here/check.sh" --config "$tmp/vsock-m.config"

for opt in ACPI PCI MODULES; do
	{ cat "$good_config"; echo "CONFIG_$opt=y"; } >"$tmp/with-$opt.config"
	expect_fail "CONFIG_$opt=y is rejected" "CONFIG_$opt must not be set" \
		"$here/check.sh" --config "$tmp/with-$opt.config"
done

# The core list holds even when someone trims the fragment.
grep -v '^CONFIG_PVH=y$' "$here/microvm.config" >"$tmp/trimmed.fragment"
expect_fail "core requirements survive a trimmed fragment" 'CONFIG_PVH=y required \(core\)' \
	"$here/check.sh" --fragment "$tmp/trimmed.fragment" --config "$tmp/no-pvh.config"

{ cat "$here/microvm.config"; echo "CONFIG_FOO y"; } >"$tmp/bad.fragment"
expect_fail "unparsable fragment line is reported" 'unparsable line: CONFIG_FOO y' \
	"$here/check.sh" --fragment "$tmp/bad.fragment" --config "$good_config"

expect_fail "missing config file is reported" 'cannot read' \
	"$here/check.sh" --config "$tmp/does-not-exist"

head -c 4096 /dev/urandom >"$tmp/garbage"
cp "$good_config" "$tmp/garbage.config"
expect_fail "non-ELF vmlinux is rejected" 'not an ELF file' "$here/check.sh" "$tmp/garbage"

cp /usr/bin/true "$tmp/true"
cp "$good_config" "$tmp/true.config"
expect_fail "ELF without the PVH note is rejected" 'no Xen note of type 0x12' "$here/check.sh" "$tmp/true"

# A tiny ELF with a hand-made XEN_ELFNOTE_PHYS32_ENTRY note: the note parser
# must find the entry, and must tell inside from outside the loaded segments.
if command -v as >/dev/null && command -v ld >/dev/null; then
	for where in inside outside; do
		target=_start
		[[ $where == outside ]] && target=0x7f000000
		cat >"$tmp/pvh-$where.s" <<ASM
.section .note.Xen, "a", @note
.balign 4
.long 4, 8, 0x12
.asciz "Xen"
.balign 4
.quad $target
.text
.globl _start
_start: ret
ASM
		as --64 "$tmp/pvh-$where.s" -o "$tmp/pvh-$where.o" && ld -o "$tmp/pvh-$where" "$tmp/pvh-$where.o"
		cp "$good_config" "$tmp/pvh-$where.config"
	done
	out_in=$("$here/check.sh" "$tmp/pvh-inside" 2>&1 || true)
	grep -qE '^ok: +vmlinux: PVH note .*entry 0x[0-9a-f]+ inside a PT_LOAD segment' <<<"$out_in" &&
		pass "PVH note is parsed and its entry located" || { flunk "PVH note parse"; echo "$out_in" | sed 's/^/    /'; }
	expect_fail "PVH entry outside every PT_LOAD is rejected" 'PVH entry 0x7f000000 is outside every PT_LOAD' \
		"$here/check.sh" "$tmp/pvh-outside"
else
	flunk "binutils (as, ld) missing: cannot test the PVH note parser"
fi

rc=0; "$here/check.sh" >/dev/null 2>&1 || rc=$?
[[ $rc -eq 2 ]] && pass "check.sh without arguments is a usage error" || flunk "check.sh without arguments exited $rc, want 2"

if [[ -n "$vmlinux" ]]; then
	expect_ok "built vmlinux passes check.sh" "$here/check.sh" "$vmlinux"
	head -c 1048576 "$vmlinux" >"$tmp/truncated"
	cp "$vmlinux.config" "$tmp/truncated.config"
	expect_fail "truncated vmlinux is rejected" 'size|PVH|PT_LOAD' "$here/check.sh" "$tmp/truncated"
	# Strip the notes: the PVH entry is gone, the rest of the ELF is intact.
	objcopy --remove-section=.notes "$vmlinux" "$tmp/no-notes"
	cp "$vmlinux.config" "$tmp/no-notes.config"
	expect_fail "vmlinux without .notes is rejected" 'no Xen note' "$here/check.sh" "$tmp/no-notes"
fi

# --- build.sh: key and cache, on a copy of this directory ------------------------------
copy="$tmp/gk"
mkdir -p "$copy"
cp "$here/build.sh" "$here/check.sh" "$here/microvm.config" "$copy/"
k1=$("$copy/build.sh" --print-key)
k2=$("$copy/build.sh" --print-key)
[[ "$k1" =~ ^[0-9a-f]{16}$ && "$k1" == "$k2" ]] && pass "cache key is stable ($k1)" ||
	flunk "cache key unstable or malformed: '$k1' vs '$k2'"
echo "CONFIG_IKCONFIG=y" >>"$copy/microvm.config"
k3=$("$copy/build.sh" --print-key)
[[ "$k3" != "$k1" ]] && pass "cache key changes with the fragment" || flunk "cache key ignored a fragment change"
cp "$here/microvm.config" "$copy/microvm.config"

# A complete cache entry is published as-is, without unpacking or compiling.
cache="$tmp/cache"
mkdir -p "$cache/$k1"
for f in vmlinux vmlinux.config System.map build-info; do echo "cached $f" >"$cache/$k1/$f"; done
touch "$cache/$k1/complete"
start=$(date +%s%N)
if "$copy/build.sh" --cache-dir "$cache" --out "$tmp/out" >"$tmp/hit.log" 2>&1 &&
	grep -q 'cache hit' "$tmp/hit.log" && [[ "$(cat "$tmp/out/vmlinux")" == "cached vmlinux" ]]; then
	pass "cache hit publishes the entry ($(( ($(date +%s%N) - start) / 1000000 )) ms)"
else
	flunk "cache hit path"; sed 's/^/    /' "$tmp/hit.log"
fi

# An entry without its completion marker (a build that died) is not trusted:
# build.sh must build instead. A fake source tarball makes that build fail fast.
mkdir -p "$tmp/fake/linux-fake"
echo "not a kernel" >"$tmp/fake/linux-fake/README"
tar -C "$tmp/fake" -cJf "$tmp/linux-fake.tar.xz" linux-fake
kf=$("$copy/build.sh" --source "$tmp/linux-fake.tar.xz" --print-key)
[[ "$kf" != "$k1" ]] && pass "cache key changes with the source" || flunk "cache key ignored the source"
mkdir -p "$cache/$kf"
for f in vmlinux vmlinux.config System.map build-info; do echo "stale $f" >"$cache/$kf/$f"; done
rc=0; "$copy/build.sh" --source "$tmp/linux-fake.tar.xz" --cache-dir "$cache" --out "$tmp/out3" >"$tmp/stale.log" 2>&1 || rc=$?
if [[ $rc -ne 0 ]] && grep -q 'does not look like a kernel source tree' "$tmp/stale.log" && [[ ! -e "$tmp/out3/vmlinux" ]]; then
	pass "incomplete cache entry is not reused"
else
	flunk "incomplete cache entry (rc $rc)"; sed 's/^/    /' "$tmp/stale.log"
fi
rc=0; "$copy/build.sh" --jobs 0 --cache-dir "$cache" --out "$tmp/out2" >"$tmp/jobs.log" 2>&1 || rc=$?
[[ $rc -ne 0 ]] && grep -q -- '--jobs wants a positive integer' "$tmp/jobs.log" && pass "--jobs 0 is a clear error" ||
	flunk "--jobs 0 was accepted (rc $rc)"
rc=0; "$copy/build.sh" --source "$tmp/nope.tar.xz" --cache-dir "$cache" --out "$tmp/out2" >"$tmp/src.log" 2>&1 || rc=$?
[[ $rc -ne 0 ]] && grep -q 'not found' "$tmp/src.log" && pass "missing source tarball is a clear error" ||
	flunk "missing source tarball (rc $rc)"

echo "selftest.sh: $passed passed, $failed failed"
((failed == 0))
