#!/usr/bin/env bash
# Installs the pinned npm `e2b` SDK versions of the npm acceptance suite into a cache dir
# (idempotent; offline once installed): $CUBE_NPM_ROOT/e2b-<x.y>/node_modules/e2b.
# Needs node >= 20.18.1 and npm (Debian 12's nodejs 18 is too old for e2b 2.51).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=${CUBE_NPM_ROOT:-/var/cache/cube/npm}
for dir in "$HERE"/npm/e2b-*; do
    name=$(basename "$dir")
    dest="$ROOT/$name"
    want=$(node -p "require('$dir/package.json').dependencies.e2b")
    have=$(node -p "try { require('$dest/node_modules/e2b/package.json').version } catch (e) { '' }")
    if [ "$want" = "$have" ] && cmp -s "$dir/package-lock.json" "$dest/package-lock.json"; then
        continue
    fi
    mkdir -p "$dest"
    cp "$dir/package.json" "$dir/package-lock.json" "$dest/"
    (cd "$dest" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
    echo "installed $name ($want) in $dest"
done
