#!/usr/bin/env bash
# Builds the `code-interpreter-v1` template (the e2b-code-interpreter SDK's default): Debian
# bookworm with Python 3, numpy, pandas and matplotlib from Debian, and cube-agent configured to
# serve the code-interpreter protocol on port 49999.
#
#   build.sh [--cubelet PATH] [--config CUBELET_TOML] [--name NAME] [--cache DIR] [--root-only DIR]
#
# Two cached steps, so CI pays for debootstrap once:
#   1. debootstrap into $CACHE/code-interpreter-<key>/root, keyed by suite, packages, mirror and
#      this recipe's version (skipped when that directory is complete);
#   2. `cubelet build-template NAME --dir <that root, plus the agent config>`, which is itself
#      content addressed (same tree and agent binary = the existing build is reused).
# --root-only DIR stops after assembling the root directory in DIR (for inspection or tests).
set -euo pipefail

CUBELET=${CUBELET:-cubelet}
CONFIG=""
NAME=code-interpreter-v1
CACHE=${CUBE_TEMPLATE_CACHE:-/var/cache/cube/templates}
ROOT_ONLY=""
SUITE=bookworm
MIRROR=${CUBE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES="bash,ca-certificates,coreutils,procps,python3,python3-matplotlib,python3-numpy,python3-pandas"
# Bump when the steps below change what ends up in the cached root.
RECIPE=1

while [ $# -gt 0 ]; do
    case "$1" in
        --cubelet) CUBELET=$2; shift 2 ;;
        --config) CONFIG=$2; shift 2 ;;
        --name) NAME=$2; shift 2 ;;
        --cache) CACHE=$2; shift 2 ;;
        --root-only) ROOT_ONLY=$2; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

[ "$(id -u)" = 0 ] || { echo "build.sh: needs root (debootstrap, chroot)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "build.sh: debootstrap is not installed" >&2; exit 1; }

key=$(printf 'code-interpreter:r%s:%s:%s:%s' "$RECIPE" "$SUITE" "$PACKAGES" "$MIRROR" | sha256sum | cut -c1-16)
base="$CACHE/code-interpreter-$key"
mkdir -p "$CACHE"

if [ ! -e "$base/complete" ]; then
    tmp="$CACHE/.tmp-code-interpreter-$key-$$"
    rm -rf "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp"
    echo "==> debootstrap $SUITE with $PACKAGES (cached afterwards in $base)" >&2
    t0=$(date +%s)
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp/root" "$MIRROR" >&2
    echo "==> debootstrap took $(( $(date +%s) - t0 )) s" >&2
    # Matplotlib builds its font cache on first import (seconds): do it now, as the sandbox user
    # (uid 1000, home /home/user), so the first chart in a sandbox is fast.
    mkdir -p "$tmp/root/home/user/.cache"
    chown -R 1000:1000 "$tmp/root/home/user"
    chroot --userspec=1000:1000 "$tmp/root" /usr/bin/env -i HOME=/home/user MPLBACKEND=Agg \
        /usr/bin/python3 -c 'import matplotlib.pyplot, numpy, pandas' >&2
    # Not needed at run time; keeps the image (and every sandbox clone) smaller.
    rm -rf "$tmp/root/var/cache/apt/archives" "$tmp/root/var/lib/apt/lists" \
        "$tmp/root/usr/share/doc" "$tmp/root/usr/share/man" "$tmp/root/usr/share/locale"
    mkdir -p "$tmp/root/var/cache/apt/archives/partial" "$tmp/root/var/lib/apt/lists/partial"
    touch "$tmp/complete"
    rm -rf "$base"
    mv "$tmp" "$base"
    trap - EXIT
fi

# The agent config is part of the cached root (written every time so that a changed recipe
# text takes effect); cubelet copies the tree itself, so there is no staging copy here.
cat > "$base/root/etc/.cube-agent.toml.$$" <<'EOF'
# Written by deploy/templates/code-interpreter-v1/build.sh.
hostname = "sandbox"

[interpreter]
# The e2b-code-interpreter protocol (POST /execute, /contexts) on port 49999.
enabled = true
port = 49999
EOF
mv "$base/root/etc/.cube-agent.toml.$$" "$base/root/etc/cube-agent.toml"

if [ -n "$ROOT_ONLY" ]; then
    rm -rf "$ROOT_ONLY"
    cp -a --reflink=auto "$base/root" "$ROOT_ONLY"
    echo "$ROOT_ONLY"
    exit 0
fi

args=()
[ -n "$CONFIG" ] && args+=(--config "$CONFIG")
"$CUBELET" "${args[@]}" build-template "$NAME" --dir "$base/root"
