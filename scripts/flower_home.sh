#!/usr/bin/env bash
# Make `flwr run .` work from this checkout with the activated virtualenv (called by `make venv`).
#
#   scripts/flower_home.sh [VENV]      (default .venv)
#
# Flower keeps its federations and its local SuperLink's state in $FLWR_HOME (default ~/.flwr).
# This writes a project-local one, <repo>/.flwr, whose local simulation federation has as many
# SuperNodes as the app's default `num-clients` (3) and gives each ClientApp one CPU (Flower's
# default of 2 serialises the clients on a 2-core machine). It then appends to the venv's
# `activate` script:
#   FLWR_HOME=<repo>/.flwr
#   FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1   the venv already holds every dependency; a
#       SuperLink would otherwise download them again (uv sync) before each run
#   FLWR_LOCAL_SUPERLINK_HTTP_API_PORT / FLWR_LOCAL_CONTROL_API_PORT   ports of this checkout's
#       local SuperLink, apart from Flower's defaults (39091 / 39093) and drawn from the
#       checkout's path (39300-40099), so that a SuperLink another project or another checkout
#       of this one started is not reused by mistake: `flwr run` reuses whatever SuperLink
#       answers on its port, which runs the code of the venv that started it and writes its
#       runs under that checkout
# Idempotent: an existing config.toml is kept, and the block is appended once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
HOME_DIR="$ROOT/.flwr"
mkdir -p "$HOME_DIR"
if [[ ! -f "$HOME_DIR/config.toml" ]]; then
    cat >"$HOME_DIR/config.toml" <<TOML
[superlink]
default = "local"

[superlink.local]
address = ":local:"
options.num-supernodes = 3
options.backend.client-resources.num-cpus = 1
options.backend.client-resources.num-gpus = 0.0
TOML
fi
ACTIVATE="$VENV/bin/activate"
OFFSET=$(( $(printf '%s' "$ROOT" | cksum | cut -d' ' -f1) % 400 ))
HTTP_PORT=$(( 39300 + 2 * OFFSET ))
MARK="# fl-attack: Flower settings for \`flwr run .\`"
if [[ -f "$ACTIVATE" ]] && ! grep -qF "$MARK" "$ACTIVATE"; then
    cat >>"$ACTIVATE" <<SH

$MARK (scripts/flower_home.sh)
export FLWR_HOME="$HOME_DIR"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=$HTTP_PORT
export FLWR_LOCAL_CONTROL_API_PORT=$(( HTTP_PORT + 1 ))
SH
fi
