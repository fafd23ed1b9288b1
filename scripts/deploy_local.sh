#!/usr/bin/env bash
# make deploy-local: the docker-compose topology as local processes, end to end.
#
#   flower-superlink   (ServerApp side: runs the audited ServerApp in a subprocess)
#   flower-supernode x NUM_NODES, each with its partition via --node-config
#   flwr run . deploy-local --stream    (FLWR_HOME is a temporary directory)
#
# It waits for the run to finish, checks `flwr ls --format json` for `finished:completed` (the
# exit status of `flwr run --stream` is 0 even when the run failed), checks that the audit wrote
# its summary, stops everything it started (trap on EXIT) and leaves the run's artifacts in
# $OUTPUT_DIR/<run-name>/. Exit status 0 only when the run completed.
#
# Environment (all optional):
#   NUM_NODES   SuperNodes to start (default 2)
#   OUTPUT_DIR  where the run directory goes (default <repo>/runs)
#   RUN_CONFIG  extra `--run-config` overrides, e.g. "protocol='fedavg' audit=true"
#   TIMEOUT     seconds to wait for the run (default 900)
#   VENV        virtualenv with flwr (default <repo>/.venv)
#
# Processes use subprocess isolation (SuperLink and SuperNodes start the ServerApp / ClientApps
# themselves), so no SuperExec processes are needed. Ports are picked free at start, so several
# deployments (or other Flower users on the machine) do not collide.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(cd "${VENV:-$ROOT/.venv}" && pwd)"  # absolute: PATH and the children need it
BIN="$VENV/bin"
NUM_NODES="${NUM_NODES:-2}"
OUTPUT_DIR="${OUTPUT_DIR:-$ROOT/runs}"
mkdir -p -m 700 "$OUTPUT_DIR"
OUTPUT_DIR="$(cd "$OUTPUT_DIR" && pwd)"  # absolute: the ServerApp runs elsewhere
TIMEOUT="${TIMEOUT:-900}"
RUN_NAME="deploy-$(date -u +%Y%m%d-%H%M%S)-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/fl-attack-deploy.XXXXXX")"
export FLWR_HOME="$WORK/flwr-home"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_DISABLE_UPDATE_CHECK=1
export PYTHONUNBUFFERED=1
export PATH="$BIN:$PATH"  # the SuperLink/SuperNodes start flower-superexec / flwr-* by name
mkdir -p "$FLWR_HOME" "$OUTPUT_DIR"
PIDS=()

log() { printf '[deploy-local] %s\n' "$*" >&2; }

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if ((${#PIDS[@]})); then
        log "stopping ${#PIDS[@]} process group(s): ${PIDS[*]}"
        for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
        for _ in $(seq 1 50); do
            local alive=0
            for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
            ((alive)) || break
            sleep 0.2
        done
        for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; done
        wait 2>/dev/null || true
    fi
    if ((rc != 0)); then
        for f in "$WORK"/*.log; do
            [[ -f "$f" ]] || continue
            log "---- last lines of $(basename "$f") ----"
            tail -n 25 "$f" >&2 || true
        done
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    "$BIN/python" - <<'EOF'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()
EOF
}

# Start "$@" in its own process group (setsid) so that cleanup reaches its children too.
start() {
    local name="$1"; shift
    setsid "$@" >"$WORK/$name.log" 2>&1 &
    PIDS+=("$!")
    log "started $name (pid $!)"
}

wait_port() {
    local port="$1" name="$2"
    for _ in $(seq 1 300); do
        if "$BIN/python" -c "import socket,sys; s=socket.socket(); s.settimeout(0.5); sys.exit(s.connect_ex(('127.0.0.1', $port)))"; then
            return 0
        fi
        for pid in "${PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || { log "$name: a process died while waiting"; return 1; }
        done
        sleep 0.2
    done
    log "$name did not open port $port"; return 1
}

cd "$ROOT"
# Small by default: one round, batch 8, width 100, MNIST; audit off (a real deployment has no
# ground truth). RUN_CONFIG is appended, so it overrides these.
BASE_CONFIG="num-server-rounds=1 num-clients=$NUM_NODES batch-size=8 width=100 dataset='mnist' dataset-size=400 max-seconds=60.0 audit=false audit-executor='pool' output-dir='$OUTPUT_DIR' run-name='$RUN_NAME'"
# A bad setting fails here, naming the key, before any process starts.
"$BIN/python" -m fl_attack_flwr.app.run_config "$BASE_CONFIG" "${RUN_CONFIG:-}" || {
    log "invalid run config: nothing was started"; exit 2; }

LINK_PORT="$(free_port)"
log "FLWR_HOME=$FLWR_HOME, SuperLink on 127.0.0.1:$LINK_PORT, $NUM_NODES SuperNodes"

start superlink "$BIN/flower-superlink" --insecure --isolation subprocess \
    --host 127.0.0.1 --port "$LINK_PORT" --disable-runtime-dependency-installation
wait_port "$LINK_PORT" superlink

for ((i = 0; i < NUM_NODES; i++)); do
    node_port="$(free_port)"
    start "supernode-$i" "$BIN/flower-supernode" --insecure --superlink "127.0.0.1:$LINK_PORT" \
        --isolation subprocess --host 127.0.0.1 --port "$node_port" \
        --node-config "partition-id=$i num-partitions=$NUM_NODES"
done

cat >"$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "deploy-local"

[superlink.deploy-local]
address = "127.0.0.1:$LINK_PORT"
insecure = true
EOF

log "flwr run . deploy-local --stream (run-name $RUN_NAME)"
set +e
RUN_ARGS=(--run-config "$BASE_CONFIG")
[[ -n "${RUN_CONFIG:-}" ]] && RUN_ARGS+=(--run-config "$RUN_CONFIG")
timeout "$TIMEOUT" "$BIN/flwr" run . deploy-local --stream "${RUN_ARGS[@]}" 2>&1 \
    | tee "$WORK/flwr-run.log" >&2
run_rc=${PIPESTATUS[0]}
set -e
if ((run_rc != 0)); then
    log "flwr run exited with status $run_rc"
    exit 1
fi

# `flwr run --stream` returns 0 even when the run failed: ask the SuperLink. The stream ends
# when the run finishes, so the status settles within seconds.
status=""
for _ in $(seq 1 30); do
    status="$("$BIN/flwr" ls deploy-local --format json 2>/dev/null | "$BIN/python" -c '
import json, sys
try:
    runs = json.load(sys.stdin).get("runs", [])
except ValueError:
    runs = []
print(runs[-1].get("status", "") if runs else "")
')" || status=""
    [[ "$status" == finished* ]] && break
    sleep 2
done
log "run status: ${status:-unknown}"
if [[ "$status" != "finished:completed" ]]; then
    log "the run did not complete"
    exit 1
fi
summary="$OUTPUT_DIR/$RUN_NAME/summary.json"
if [[ ! -f "$summary" ]]; then
    log "no audit summary at $summary"
    exit 1
fi
"$BIN/python" - "$summary" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("status", "reconstructions", "certified", "protected", "psnr_mean", "epsilon")
print("[deploy-local] " + ", ".join(f"{k}={s.get(k)}" for k in keys), file=sys.stderr)
print("[deploy-local] verdict: " + str(s.get("verdict")), file=sys.stderr)
sys.exit(0 if s.get("status") == "completed" else 1)
EOF
log "artifacts: $OUTPUT_DIR/$RUN_NAME (report: $OUTPUT_DIR/$RUN_NAME/report.html)"
echo "$OUTPUT_DIR/$RUN_NAME"
