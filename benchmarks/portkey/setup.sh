#!/usr/bin/env bash
# Install the pinned Portkey gateway into benchmarks/.portkey, the second peer of the side-by-side
# benchmarks (DESIGN §12). It is never a dependency of modelcanary itself. Needs Node >= 18 and npm.
#
# package.json + package-lock.json here pin the whole tree (`npm ci`), with hono and
# @hono/node-server at the versions of Portkey's own lockfile (see package.json's description).
# --ignore-scripts: the gateway's only install script is `patch-package`, and it ships no patches.
set -euo pipefail

VERSION="1.15.2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${PORTKEY_DIR:-$HERE/../.portkey}"
STAMP="$DIR/.installed-$VERSION"
ENTRY="$DIR/node_modules/@portkey-ai/gateway/build/start-server.js"

if [ -f "$STAMP" ] && [ -f "$ENTRY" ] && cmp -s "$HERE/package-lock.json" "$DIR/package-lock.json"; then
  exit 0
fi
command -v node >/dev/null || { echo "node is not installed (Portkey's gateway needs Node >= 18)" >&2; exit 1; }
command -v npm >/dev/null || { echo "npm is not installed" >&2; exit 1; }
MAJOR="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$MAJOR" -lt 18 ]; then
  echo "node $(node --version) is too old: Portkey's gateway needs Node >= 18" >&2
  exit 1
fi
mkdir -p "$DIR"
rm -f "$DIR"/.installed-*
cp "$HERE/package.json" "$HERE/package-lock.json" "$DIR/"
(cd "$DIR" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
test -f "$ENTRY"
touch "$STAMP"
echo "@portkey-ai/gateway $VERSION installed in $DIR"
