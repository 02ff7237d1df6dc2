#!/usr/bin/env bash
# Build the Cube microVM guest kernel (an uncompressed PVH-bootable vmlinux)
# from Debian's linux-source-6.12: `make tinyconfig` + microvm.config, verified
# by check.sh, cached by a key over everything that decides the result.
#
#   build.sh [--out DIR] [--jobs N] [--source TARBALL] [--cache-dir DIR]
#            [--no-cache] [--keep-build] [--print-key]
#
#   --out DIR        where vmlinux, vmlinux.config, System.map and build-info go
#                    (default: out/ next to this script)
#   --jobs N         parallel make jobs (default: number of CPUs)
#   --source FILE    kernel source tarball (default: /usr/src/linux-source-6.12.tar.xz,
#                    from the Debian package linux-source-6.12)
#   --cache-dir DIR  build cache (default: /var/cache/cube/guest-kernel); an entry
#                    <DIR>/<key>/vmlinux is reused without building
#   --no-cache       neither reuse nor store a cache entry
#   --keep-build     keep the build tree (its path is printed)
#   --print-key      print the cache key and exit
#
# Share the machine politely: run it as `nice -n 19 ./build.sh`.
set -euo pipefail

# The whole script is one brace group: bash parses it completely before running
# it, so editing this file cannot derail a build in progress.
{
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fragment="$here/microvm.config"
out="$here/out"
jobs=$(nproc 2>/dev/null || echo 2)
source_tarball=/usr/src/linux-source-6.12.tar.xz
source_package=linux-source-6.12
cache_root=/var/cache/cube/guest-kernel
use_cache=1
keep_build=0
print_key=0

# Packages the build needs (Debian names). dwarves (pahole) only matters if BTF
# is ever enabled; it is listed so adding CONFIG_DEBUG_INFO_BTF just works.
build_packages=(build-essential bc bison flex libelf-dev libssl-dev dwarves cpio xz-utils binutils patch)

die() { echo "build.sh: error: $*" >&2; exit 1; }
log() { echo "build.sh: $*" >&2; }
usage() { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }

while [[ $# -gt 0 ]]; do
	case "$1" in
	--out) [[ $# -ge 2 ]] || usage; out=$2; shift 2 ;;
	--jobs) [[ $# -ge 2 ]] || usage; jobs=$2; shift 2 ;;
	--source) [[ $# -ge 2 ]] || usage; source_tarball=$2; source_package=""; shift 2 ;;
	--cache-dir) [[ $# -ge 2 ]] || usage; cache_root=$2; shift 2 ;;
	--no-cache) use_cache=0; shift ;;
	--keep-build) keep_build=1; shift ;;
	--print-key) print_key=1; shift ;;
	-h | --help) usage ;;
	*) echo "build.sh: unknown argument: $1" >&2; usage ;;
	esac
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || die "--jobs wants a positive integer, got '$jobs'"
[[ -r "$fragment" ]] || die "config fragment $fragment is missing"

# --- dependencies -------------------------------------------------------------------
ensure_packages() {
	local missing=() p status
	# One dpkg-query for all packages: this runs on every cache hit too.
	declare -A installed=()
	while read -r p status; do
		[[ "$status" == "install ok installed" ]] && installed[$p]=1
	done < <(dpkg-query -W -f='${Package} ${Status}\n' "$@" 2>/dev/null || true)
	for p in "$@"; do [[ -n "${installed[$p]:-}" ]] || missing+=("$p"); done
	[[ ${#missing[@]} -eq 0 ]] && return 0
	[[ $(id -u) -eq 0 ]] || die "missing packages: ${missing[*]} (run as root or: apt-get install ${missing[*]})"
	log "installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; then
		# A fresh CI image may have no package lists yet.
		apt-get update -q >&2 || die "apt-get update failed"
		apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 ||
			die "apt-get install ${missing[*]} failed"
	fi
}
command -v dpkg-query >/dev/null || die "this script needs a Debian-based system (dpkg-query not found)"
pkgs=("${build_packages[@]}")
[[ -z "$source_package" ]] || pkgs+=("$source_package")
ensure_packages "${pkgs[@]}"
[[ -r "$source_tarball" ]] || die "kernel source $source_tarball not found"

# --- cache key -------------------------------------------------------------------------
# Everything that changes the output: the fragment, this recipe, the source
# (the Debian package's version for the default tarball, the tarball's own hash
# when given with --source) and the toolchain.
source_identity() {
	if [[ -n "$source_package" ]]; then
		echo "deb $source_package $(dpkg-query -W -f='${Version}' "$source_package") $(stat -c '%s' "$source_tarball")"
	else
		echo "sha256 $(sha256sum "$source_tarball" | cut -d' ' -f1)"
	fi
}
src_id=$(source_identity)
# Source patches (patches/*.patch, applied in name order with -p1): see patches/README.md.
shopt -s nullglob
patches=("$here"/patches/*.patch)
shopt -u nullglob
toolchain="$(gcc --version | head -n1); $(ld --version | head -n1)"
key=$( {
	echo "cube-guest-kernel"
	echo "source: $src_id"
	echo "toolchain: $toolchain"
	echo "--- fragment"; cat "$fragment"
	echo "--- recipe"; cat "${BASH_SOURCE[0]}"
	for p in "${patches[@]}"; do echo "--- patch $(basename "$p")"; cat "$p"; done
} | sha256sum | cut -c1-16)

if ((print_key)); then
	echo "$key"
	exit 0
fi

publish() { # dir holding a finished build → $out
	mkdir -p "$out" || die "cannot create output directory $out"
	local f
	for f in vmlinux vmlinux.config System.map build-info; do
		cp --reflink=auto -f "$1/$f" "$out/$f.tmp.$$"
		mv -f "$out/$f.tmp.$$" "$out/$f"
	done
	log "vmlinux: $out/vmlinux ($(stat -c %s "$out/vmlinux") bytes), key $key"
}

entry=""
if ((use_cache)); then
	entry="$cache_root/$key"
	mkdir -p "$cache_root" 2>/dev/null || die "cannot create cache directory $cache_root (use --cache-dir DIR or --no-cache)"
	if [[ -f "$entry/complete" ]]; then
		log "cache hit: $entry"
		publish "$entry"
		exit 0
	fi
	# One build per key at a time; a second caller waits and then reuses it.
	exec 9>"$cache_root/.lock-$key" || die "cannot write lock file in $cache_root"
	flock 9
	if [[ -f "$entry/complete" ]]; then
		log "cache hit after waiting for a concurrent build: $entry"
		publish "$entry"
		exit 0
	fi
fi

# --- build ----------------------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/var/tmp}/cube-guest-kernel.XXXXXX")
cleanup() {
	if ((keep_build)); then
		log "build tree kept: $work"
	else
		rm -rf "$work"
	fi
}
trap cleanup EXIT
src="$work/src"
mkdir -p "$src"
t0=$(date +%s.%N)

# Skip what a vmlinux for x86 never reads (~0.7 GB of the 1.5 GB tree): other
# architectures' sources and device trees (their Kconfig files stay: the
# generic Kconfig sources them), documentation bodies (Documentation/Kconfig
# stays), userspace tool tests, and the amdgpu register headers.
top=$(basename "$source_tarball"); top=${top%.tar.*}
excludes=(
	"$top/Documentation/*/*"
	"$top/tools/testing" "$top/tools/perf"
	"$top/drivers/gpu/drm/amd/*.[ch]"
)
for a in alpha arc arm arm64 csky hexagon loongarch m68k microblaze mips nios2 openrisc \
	parisc powerpc riscv s390 sh sparc um xtensa; do
	excludes+=("$top/arch/$a/*.[chS]" "$top/arch/$a/boot/dts")
done
log "unpacking $source_tarball"
xz -T"$jobs" -dc "$source_tarball" |
	tar -x -C "$src" --strip-components=1 --anchored "${excludes[@]/#/--exclude=}" ||
	die "unpacking $source_tarball failed"
[[ -f "$src/Makefile" && -f "$src/scripts/kconfig/merge_config.sh" ]] ||
	die "$source_tarball does not look like a kernel source tree"
for p in "${patches[@]}"; do
	log "applying $(basename "$p")"
	patch -s -p1 -d "$src" <"$p" || die "patch $p does not apply"
done
t_unpack=$(date +%s.%N)

kmake() { make -C "$src" ARCH=x86_64 "$@"; }
log "configuring: tinyconfig + $(basename "$fragment")"
{
	kmake -s tinyconfig &&
		(cd "$src" && scripts/kconfig/merge_config.sh -m .config "$fragment") &&
		kmake -s olddefconfig
} >"$work/config.log" 2>&1 || { tail -n 30 "$work/config.log" >&2; die "kernel configuration failed"; }
# Kconfig silently drops options whose dependencies are unmet: fail here,
# before spending minutes compiling the wrong kernel.
"$here/check.sh" --fragment "$fragment" --config "$src/.config" >&2 ||
	die "the final .config lacks required options (see above)"

log "compiling vmlinux with $jobs job(s)"
# Fixed build identity so the same inputs give the same banner.
export KBUILD_BUILD_USER=cube KBUILD_BUILD_HOST=cube
export KBUILD_BUILD_TIMESTAMP="$(date -u -d "@$(stat -c %Y "$source_tarball")" '+%Y-%m-%d %H:%M:%S UTC')"
if ! kmake -j"$jobs" vmlinux >"$work/build.log" 2>&1; then
	grep -E 'error|Error' "$work/build.log" | tail -n 20 >&2 || true
	tail -n 20 "$work/build.log" >&2
	die "kernel build failed (keep the tree with --keep-build to inspect $work/build.log)"
fi
t_done=$(date +%s.%N)

stage="$work/stage"
mkdir -p "$stage"
cp "$src/vmlinux" "$stage/vmlinux"
cp "$src/.config" "$stage/vmlinux.config"
cp "$src/System.map" "$stage/System.map"
{
	echo "key: $key"
	echo "source: $src_id"
	echo "kernel: $(kmake -s kernelrelease 2>/dev/null)"
	echo "toolchain: $toolchain"
	echo "jobs: $jobs"
	printf 'unpack_s: %.1f\n' "$(echo "$t_unpack - $t0" | bc)"
	printf 'build_s: %.1f\n' "$(echo "$t_done - $t_unpack" | bc)"
	echo "built_at: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$stage/build-info"
"$here/check.sh" --fragment "$fragment" "$stage/vmlinux" >&2 || die "the built vmlinux failed check.sh"

if [[ -n "$entry" ]]; then
	# Stage next to the entry and rename, so readers never see half an entry.
	tmp_entry=$(mktemp -d "$cache_root/.tmp-$key.XXXXXX")
	cp "$stage"/* "$tmp_entry/"
	chmod 755 "$tmp_entry"
	touch "$tmp_entry/complete"
	rm -rf "$entry"
	mv "$tmp_entry" "$entry"
	log "cached: $entry"
	publish "$entry"
else
	publish "$stage"
fi
cat "$out/build-info" >&2
exit 0
}
