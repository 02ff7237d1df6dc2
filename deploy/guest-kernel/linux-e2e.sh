#!/usr/bin/env bash
# The Linux-guest path of the microvm runtime, end to end, in three modes:
#
#   linux-e2e.sh                      test it on this host's /dev/kvm (hardware or PVM): the
#                                     cube-shim Linux-guest test and the E2B SDK microVM test
#   linux-e2e.sh --pack FILE          on a build host: release binaries, the static cube-agent,
#                                     the guest kernel and a small template root in one tarball
#                                     (FILE, .tar.xz) for a machine with hardware KVM and no network
#   linux-e2e.sh --measure DIR [--out FILE] [--quick | --smoke]
#                                     on that machine, as root, DIR holding the unpacked tarball:
#                                     measures the microvm runtime on VMX/SVM and writes the numbers
#                                     as JSON (FILE, default DIR/linux-e2e.json); --quick takes
#                                     fewer samples, --smoke a handful (checks the script itself
#                                     where timings mean nothing, e.g. nested under QEMU TCG)
#
# --measure runs node-bench (a cubelet on the microvm runtime with the Linux guest: warm-pool
# create at the node, host memory per idle 512 MiB sandbox, pause to disk, resume), shim-bench
# with 2 GiB guests dirtying 64 MiB (pause to disk and resume at the VMM), and `cubectl up` on the
# microvm runtime with cube-bench --quick (create and commands.run through the E2B API, as the
# SDK sees them). It installs cube-shim and vmlinux into /usr/lib/cube (cubelet's defaults) and
# refuses to run where /dev/kvm is not VMX/SVM. The targets it reports against (issue: microVM on
# hardware KVM): node create p50 <= 10 ms, API create p50 <= 20 ms, commands.run <= 10 ms, pause
# to disk (2 GiB, 64 MiB dirty) <= 150 ms, resume <= 5 ms, <= 8 MiB per idle 512 MiB sandbox.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
die() { echo "linux-e2e.sh: FAIL: $*" >&2; exit 1; }
usage() { sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }

mode=test pack="" dir="" out="" scale=full
while [[ $# -gt 0 ]]; do
	case "$1" in
	--pack) [[ $# -ge 2 ]] || usage; mode=pack; pack=$2; shift 2 ;;
	--measure) [[ $# -ge 2 ]] || usage; mode=measure; dir=$(cd "$2" && pwd); shift 2 ;;
	--out) [[ $# -ge 2 ]] || usage; out=$2; shift 2 ;;
	--quick) scale=quick; shift ;;
	--smoke) scale=smoke; shift ;;
	-h | --help) usage ;;
	*) echo "linux-e2e.sh: unknown argument: $1" >&2; usage ;;
	esac
done
hw_kvm() { [[ -c /dev/kvm ]] && grep -qwE 'vmx|svm' /proc/cpuinfo; }
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cube/target}
kout=${CUBE_KERNEL_OUT:-/var/cache/cube/guest-kernel/out}
PACKED_BINS=(cubelet cube-shim cube-master cube-api cubectl node-bench shim-bench cube-bench)

case $mode in
test)
	[[ -c /dev/kvm ]] || die "no /dev/kvm on this host"
	if hw_kvm; then kind=hardware; else kind=pvm; fi
	export CUBE_AGENT_BIN=${CUBE_AGENT_BIN:-$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent}
	[[ -x $CUBE_AGENT_BIN ]] || die "static cube-agent $CUBE_AGENT_BIN missing (see tests/run.sh)"
	venv=${CUBE_VENV_ROOT:-/var/cache/cube/venv}/e2e
	[[ -x $venv/bin/python ]] || die "virtualenv $venv missing: run deploy/deps.sh --test"
	"$here/build.sh" --out "$kout" || die "guest kernel build failed"
	"$here/check.sh" "$kout/vmlinux" || die "guest kernel check failed"
	export CUBE_GUEST_KERNEL=$kout/vmlinux CUBE_REQUIRE_KVM=1 CUBE_REQUIRE_PRIV=1
	echo "linux-e2e: /dev/kvm is $kind; kernel $CUBE_GUEST_KERNEL"
	cd "$repo"
	cargo build --quiet -p cubelet -p cube-shim -p cube-master -p cube-api -p cubectl
	cargo test --quiet -p cube-shim --test linux_guest -- --nocapture || die "cube-shim Linux guest test"
	"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/e2e/test_microvm.py ||
		die "E2B SDK against Linux microVMs"
	echo "linux-e2e: OK ($kind KVM)"
	;;
pack)
	cd "$repo"
	"$here/build.sh" --out "$kout" >/dev/null || die "guest kernel build failed"
	RUSTFLAGS="-C target-feature=+crt-static" cargo build --quiet --release -p cube-agent \
		--target x86_64-unknown-linux-gnu || die "static cube-agent build failed"
	args=()
	for b in "${PACKED_BINS[@]}"; do args+=(-p "$b"); done
	cargo build --quiet --release "${args[@]}" --features node-bench/microvm || die "release build failed"
	stage=$(mktemp -d /var/tmp/linux-e2e-pack.XXXXXX)
	trap 'rm -rf "$stage"' EXIT
	mkdir -p "$stage/cube/bin"
	for b in "${PACKED_BINS[@]}"; do strip -o "$stage/cube/bin/$b" "$CARGO_TARGET_DIR/release/$b"; done
	strip -o "$stage/cube/cube-agent" "$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent"
	cp "$kout/vmlinux" "$kout/build-info" "$stage/cube/"
	cp "${BASH_SOURCE[0]}" "$stage/cube/linux-e2e.sh"
	# The template root: a few static busybox programs are enough for create + commands.run.
	"$stage/cube/bin/cubelet" host-root "$stage/cube/root" \
		--programs sh,bash,cat,echo,ls,sleep,mkdir,rm,id,env,true,head >/dev/null ||
		die "cubelet host-root failed"
	git -C "$repo" rev-parse HEAD >"$stage/cube/commit" 2>/dev/null || true
	tar -C "$stage" -cJf "$pack" cube
	size=$(stat -c %s "$pack")
	echo "linux-e2e: packed $pack ($((size / 1048576)) MiB): run 'tar xJf $(basename "$pack") && bash cube/linux-e2e.sh --measure cube' as root on a VMX/SVM host"
	((size <= 64 * 1048576)) || die "$pack is over 64 MiB"
	;;
measure)
	[[ $(id -u) -eq 0 ]] || die "--measure needs root"
	hw_kvm || die "/dev/kvm is missing or not hardware KVM (no vmx/svm flag): nothing to measure here"
	[[ -x $dir/bin/cubelet && -f $dir/vmlinux && -x $dir/cube-agent ]] || die "$dir is not an unpacked --pack tarball"
	out=${out:-$dir/linux-e2e.json}
	res=$(mktemp -d /var/tmp/linux-e2e-measure.XXXXXX)
	bench=(--quick)
	case $scale in
	full) n=100 idle=200 shims=20 bench=() ;;
	quick) n=10 idle=10 shims=4 ;;
	smoke) n=3 idle=2 shims=1 bench=(--quick --concurrency 1 --samples 4 --no-density --dirty-mib 0 --reps 1) ;;
	esac
	install -d /usr/lib/cube
	install -m 0755 "$dir/bin/cube-shim" /usr/lib/cube/cube-shim
	install -m 0644 "$dir/vmlinux" /usr/lib/cube/vmlinux
	install -m 0755 "$dir/cube-agent" /usr/lib/cube/cube-agent
	export PATH="$dir/bin:$PATH" CUBE_AGENT_BIN=$dir/cube-agent
	echo "linux-e2e: node-bench (microvm, Linux guest, $n creates, $idle idle sandboxes)"
	"$dir/bin/node-bench" --runtime microvm --cubelet "$dir/bin/cubelet" --shim "$dir/bin/cube-shim" \
		--guest "$dir/vmlinux" --agent "$dir/cube-agent" --iterations "$n" --idle "$idle" \
		--out "$res/node-bench" || die "node-bench failed"
	echo "linux-e2e: shim-bench (2 GiB guests, 64 MiB dirtied before pause to disk)"
	"$dir/bin/shim-bench" --shim "$dir/bin/cube-shim" --mem-mib 2048 --dirty-mib 64 \
		--iterations "$n" --shims "$shims" --out "$res/shim-bench" || die "shim-bench failed"
	echo "linux-e2e: cubectl up --runtime microvm, cube-bench ${bench[*]}"
	data=$res/cube-data
	# The target has no network: no jq or python to lean on, so the E2B variables come from the
	# `export ...` line cubectl prints and the JSON is put together by hand.
	"$dir/bin/cubectl" --data-dir "$data" up --runtime microvm --base-dir "$dir/root" \
		--agent "$dir/cube-agent" --xfs-size-gib 8 --pool 4 >"$res/up.out" || die "cubectl up failed"
	trap '"$dir/bin/cubectl" --data-dir "$data" down >/dev/null 2>&1 || true' EXIT
	exports=$(grep -m1 '^export E2B_API_URL=' "$res/up.out") || die "cubectl up printed no E2B variables"
	eval "$exports"
	"$dir/bin/cube-bench" "${bench[@]}" --out "$res/cube-bench" || die "cube-bench failed"
	parts=("$res/node-bench/results-microvm.json" "$res/shim-bench/shim-bench.json" "$res/cube-bench/cube-bench.json")
	for f in "${parts[@]}"; do [[ -s $f ]] || die "a bench wrote no $f"; done
	str() { printf '"%s"' "$(printf '%s' "$1" | sed 's/[\\"]/\\&/g')"; }
	{
		printf '{"host": {"cpu": %s, "kernel": %s, "kvm": %s},\n' \
			"$(str "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')")" \
			"$(str "$(uname -r)")" "$(str "$(grep -qw vmx /proc/cpuinfo && echo vmx || echo svm)")"
		printf ' "commit": %s, "scale": %s,\n' "$(str "$(cat "$dir/commit" 2>/dev/null)")" "$(str "$scale")"
		printf ' "node_bench": %s,\n' "$(cat "${parts[0]}")"
		printf ' "shim_bench": %s,\n' "$(cat "${parts[1]}")"
		printf ' "cube_bench": %s}\n' "$(cat "${parts[2]}")"
	} >"$out"
	echo "linux-e2e: wrote $out (raw results in $res)"
	;;
esac
