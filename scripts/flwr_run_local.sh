#!/usr/bin/env bash
# `flwr run .` on the local simulation engine (Ray) in a throw-away Flower home, cleaned up
# afterwards, with an exit status that says whether the run completed (for scripts and CI; with
# the activated venv a plain `flwr run . --stream` works too, see the README).
#
#   scripts/flwr_run_local.sh [[--run-config] OVERRIDES ...]
#   e.g. scripts/flwr_run_local.sh --run-config "protocol='fedavg' local-epochs=2"
#        scripts/flwr_run_local.sh "protocol='fedavg'" "local-epochs=2"   (the same)
#
# The overrides are checked first: a bad setting, or an argument that is not an override,
# exits 2 naming it, before anything starts. `num-clients=N` among them also sets the number
# of SuperNodes (unless NUM_SUPERNODES is set).
# Flower 1.41 always goes through a SuperLink: for the `:local:` address `flwr run` starts a
# detached local SuperLink that outlives the command. This script gives it a temporary
# FLWR_HOME (federation in $FLWR_HOME/config.toml, not in pyproject.toml), its own ports (so it
# does not reuse someone else's local SuperLink), disables runtime dependency installation,
# gives each ClientApp 1 CPU, waits for the run, checks `flwr ls --format json` for
# `finished:completed` (`--stream` exits 0 even on failure) and stops the SuperLink by its PID.
#
# Environment: NUM_SUPERNODES (default: num-clients of the overrides, else 3), OUTPUT_DIR (default
# <repo>/runs), VENV (default <repo>/.venv), SIM_PORT (default: a free port).
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(cd "${VENV:-$ROOT/.venv}" && pwd)"
BIN="$VENV/bin"
OUTPUT_DIR="${OUTPUT_DIR:-$ROOT/runs}"
mkdir -p -m 700 "$OUTPUT_DIR"
OUTPUT_DIR="$(cd "$OUTPUT_DIR" && pwd)"
OVERRIDES=()
while (($#)); do
    case "$1" in
        --run-config|-c)
            [[ $# -ge 2 ]] || { echo "[flwr-run-local] $1 needs a value" >&2; exit 2; }
            OVERRIDES+=("$2"); shift 2 ;;
        --run-config=*) OVERRIDES+=("${1#--run-config=}"); shift ;;
        -*) echo "[flwr-run-local] unknown option $1 (only --run-config OVERRIDES)" >&2; exit 2 ;;
        *) OVERRIDES+=("$1"); shift ;;
    esac
done
if [[ -z "${NUM_SUPERNODES:-}" && "${OVERRIDES[*]:-}" =~ (^|[[:space:]])num-clients=([0-9]+) ]]; then
    NUM_SUPERNODES="${BASH_REMATCH[2]}"
fi
NUM_SUPERNODES="${NUM_SUPERNODES:-3}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/fl-attack-sim.XXXXXX")"
export FLWR_HOME="$WORK/flwr-home"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_DISABLE_UPDATE_CHECK=1
export PATH="$BIN:$PATH"
free_port() {
    "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT="${SIM_PORT:-$(free_port)}"
export FLWR_LOCAL_CONTROL_API_PORT="$(free_port)"
mkdir -p "$FLWR_HOME"

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    # the SuperLink `flwr run` started is the one whose database lives in our FLWR_HOME
    for pid in $(pgrep -f -- "--database $FLWR_HOME/" || true); do
        echo "[flwr-run-local] stopping local SuperLink (pid $pid)" >&2
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cat >"$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "local"

[superlink.local]
address = ":local:"
options.num-supernodes = $NUM_SUPERNODES
options.backend.client-resources.num-cpus = 1
options.backend.client-resources.num-gpus = 0.0
EOF

cd "$ROOT"
BASE="num-clients=$NUM_SUPERNODES output-dir='$OUTPUT_DIR'"
"$BIN/python" -m fl_attack_flwr.app.run_config "$BASE" "${OVERRIDES[@]}" || exit 2
ARGS=(--run-config "$BASE")
for override in "${OVERRIDES[@]}"; do ARGS+=(--run-config "$override"); done
"$BIN/flwr" run . --stream "${ARGS[@]}"
status="$("$BIN/flwr" ls --format json | "$BIN/python" -c '
import json, sys
runs = json.load(sys.stdin).get("runs", [])
print(runs[-1]["status"] if runs else "none")')"
echo "[flwr-run-local] run status: $status (artifacts under $OUTPUT_DIR)" >&2
[[ "$status" == "finished:completed" ]]
