#!/usr/bin/env bash
# Builds the virtio-mmio fuzz target with libFuzzer and AddressSanitizer (the flags cargo-fuzz
# would pass, without needing cargo-fuzz) and runs it for a fixed time on the seed corpus
# (written fresh from `fuzz_input::seeds`) plus whatever inputs it finds. A crash, a leak, an
# out-of-bounds access or a hung input fails the run; the input is kept under artifacts/.
#
#   cube-hypervisor/fuzz/run.sh [--secs N]      (default 60; needs the nightly toolchain)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
secs=60
while [[ $# -gt 0 ]]; do
	case "$1" in
	--secs) [[ $# -ge 2 ]] || { echo "run.sh: --secs needs a value" >&2; exit 2; }; secs=$2; shift 2 ;;
	*) echo "run.sh: unknown argument: $1" >&2; exit 2 ;;
	esac
done
export PATH="$HOME/.cargo/bin:$PATH"
rustup run nightly rustc --version >/dev/null 2>&1 ||
	{ echo "run.sh: FAIL: the nightly toolchain is missing (rustup toolchain install nightly)" >&2; exit 1; }
triple=x86_64-unknown-linux-gnu
# Its own target directory: instrumented builds must not mix with the workspace's.
target=${CUBE_FUZZ_TARGET_DIR:-/var/cache/cube/fuzz-target}
flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
flags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table"
flags+=" -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Zsanitizer=address"
flags+=" -Cdebug-assertions -Coverflow-checks"
cd "$here"
# --target keeps build scripts and proc macros uninstrumented.
RUSTFLAGS="$flags" cargo +nightly build --quiet --locked --release --target "$triple" \
	--target-dir "$target" --bin virtio_mmio
bin=$target/$triple/release/virtio_mmio
work=$(mktemp -d /var/tmp/cube-fuzz.XXXXXX)
mkdir -p "$work/corpus" "$work/artifacts"
echo "fuzz: virtio_mmio for ${secs}s (corpus and artifacts in $work)"
rc=0
CUBE_FUZZ_SEEDS=$work/corpus "$bin" "$work/corpus" -max_total_time="$secs" -timeout=10 \
	-rss_limit_mb=4096 -artifact_prefix="$work/artifacts/" -print_final_stats=1 \
	>"$work/fuzz.log" 2>&1 || rc=$?
tail -n 25 "$work/fuzz.log"
if ((rc != 0)) || compgen -G "$work/artifacts/*" >/dev/null; then
	echo "fuzz: FAIL (rc $rc): the failing input is in $work/artifacts/; replay it with" \
		"$bin <file>, or add it to fuzz_input::seeds" >&2
	exit 1
fi
runs=$(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$work/fuzz.log" | grep -o '[0-9]*$' || echo 0)
((runs > 0)) || { echo "fuzz: FAIL: no input was executed" >&2; exit 1; }
echo "fuzz: passed ($runs inputs in ${secs}s, $(ls "$work/corpus" | wc -l) in the corpus)"
rm -rf "$work"
