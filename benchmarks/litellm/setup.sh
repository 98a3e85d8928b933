#!/usr/bin/env bash
# Create benchmarks/.litellm-venv with the pinned LiteLLM proxy, the peer of the side-by-side
# benchmarks. It is never a dependency of modelcanary itself (DESIGN §10).
set -euo pipefail

VERSION="1.108.7"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${LITELLM_VENV:-$HERE/../.litellm-venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed-$VERSION"

if [ -f "$STAMP" ] && [ -x "$VENV/bin/litellm" ]; then
  exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "litellm[proxy]==$VERSION"
touch "$STAMP"
echo "litellm $VERSION installed in $VENV"
