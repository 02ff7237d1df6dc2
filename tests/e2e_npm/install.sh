#!/usr/bin/env bash
# Installs the pinned npm SDKs of the acceptance suites into a cache dir (idempotent; offline
# once installed): $CUBE_NPM_ROOT/<dir>/node_modules for each tests/e2e_npm/npm/<dir> — the
# `e2b` versions of tests/e2e_npm and `@e2b/code-interpreter` for tests/interpreter.
# Needs node >= 20.18.1 and npm (Debian 12's nodejs 18 is too old for e2b 2.51).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=${CUBE_NPM_ROOT:-/var/cache/cube/npm}
for dir in "$HERE"/npm/*/; do
    dir=${dir%/}
    name=$(basename "$dir")
    dest="$ROOT/$name"
    # The lock file pins the whole tree: an install whose lock matches is current.
    if [ -d "$dest/node_modules" ] && cmp -s "$dir/package-lock.json" "$dest/package-lock.json"; then
        continue
    fi
    mkdir -p "$dest"
    cp "$dir/package.json" "$dir/package-lock.json" "$dest/"
    (cd "$dest" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
    echo "installed $name in $dest"
done
