#!/usr/bin/env bash
# make compose-demo: the docker-compose federation end to end, on a connected or air-gapped host.
#
#   1. docker daemon   use the one that answers; else start `dockerd $DOCKERD_FLAGS` (root only)
#                      and stop it (by its PID) at the end. A daemon it did not start is never
#                      stopped or reconfigured.
#   2. images          the official flwr/* images when they are present or can be pulled; else
#                      local equivalents (docker/flwr.Dockerfile) from a debootstrap Debian 12
#                      base (docker/make_base_image.sh) and a wheelhouse made on this host
#                      (docker/make_wheelhouse.sh), served to the builds over 127.0.0.1. Then
#                      the project image (Dockerfile) on top of flwr/superexec.
#   3. federation      docker-compose.yml + an override for $NUM_CLIENTS clients
#                      (scripts/compose_override.py; TLS=1: with certificates from
#                      scripts/generate_certs.sh), SuperLink published on 127.0.0.1 only.
#   4. flwr run        one audited FedSGD run on photo crops (the run config: demo_run_config)
#   5. run status      `flwr ls --format json` must say finished:completed (`flwr run --stream`
#                      exits 0 even when the run failed)
#   6. audit summary   summary.json of the run: status completed, >= 1 certified reconstruction
#   7. teardown        docker-compose down; no container of the project may be left
#
# Prints the report's path on the host as the last line of stdout. Exit status 0 only when every
# step passed; otherwise the failing step is named (with the services' last log lines).
# Idempotent: images, base file system and wheelhouse are reused; leftovers of an interrupted
# run of the same compose project are removed first.
#
# Environment (all optional):
#   NUM_CLIENTS          clients (SuperNodes) in the federation (default 3)
#   TLS                  1: TLS everywhere (certificates in .compose/certs); default 0 (--insecure)
#   IMAGES               auto (default) | official (flwr/* from Docker Hub) | local (air-gapped)
#   FL_ATTACK_RUNS_DIR   host directory of the runs (default <repo>/runs/compose; uid 49999, 700)
#   SUPERLINK_PORT       host port of the SuperLink on 127.0.0.1 (default: a free port)
#   TIMEOUT              seconds for the run (default 1200)
#   COMPOSE              compose command (default: `docker compose` if present, else docker-compose)
#   COMPOSE_PROJECT_NAME compose project (default fl-attack)
#   DOCKERD_FLAGS        flags for a daemon this script starts
#                        (default: --iptables=false --ip6tables=false --storage-driver=overlay2)
#   WHEELHOUSE_PORT      port of the wheelhouse server during local builds (default 18765; a
#                        fixed value keeps Docker's build cache valid between runs)
#   VENV                 virtualenv with flwr (default <repo>/.venv)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(cd "${VENV:-$ROOT/.venv}" && pwd)"
PY="$VENV/bin/python"
CACHE="$ROOT/.compose"
NUM_CLIENTS="${NUM_CLIENTS:-3}"
TLS="${TLS:-0}"
IMAGES="${IMAGES:-auto}"
PROJECT="${COMPOSE_PROJECT_NAME:-fl-attack}"
RUNS_DIR="${FL_ATTACK_RUNS_DIR:-$ROOT/runs/compose}"
TIMEOUT="${TIMEOUT:-1200}"
DOCKERD_FLAGS="${DOCKERD_FLAGS:---iptables=false --ip6tables=false --storage-driver=overlay2}"
WHEELHOUSE_PORT="${WHEELHOUSE_PORT:-18765}"
FLWR_VERSION=1.41.0
IMAGE_UID=49999  # the user `app` of the flwr/* images
PROJECT_IMAGE=fl-attack-superexec:latest
RUN_NAME="compose-$(date -u +%Y%m%d-%H%M%S)-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"

# The run configuration of the demo (keys of [tool.flwr.app.config] in pyproject.toml): one
# FedSGD round on 32x32 photo crops, one batch of 8 per client, every client's update attacked.
# audit=true: clients report which samples they used, so the report scores PSNR against them.
demo_run_config() {
    echo "num-server-rounds=1 num-clients=$NUM_CLIENTS protocol='fedsgd' dataset='photos32'" \
         "batch-size=8 width=200 audit=true max-seconds=60.0 audit-executor='pool'" \
         "output-dir='/app/runs'" \
         "run-name='$RUN_NAME'"
}

STEP="setup"
STEP_T0=$SECONDS
T0=$SECONDS
DOCKERD_PID=""
HTTP_PID=""
FED_UP=0
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fl-attack-compose.XXXXXX")"
export FLWR_HOME="$WORK/flwr-home" FLWR_DISABLE_UPDATE_CHECK=1
mkdir -p "$FLWR_HOME" "$CACHE/logs"

log() { printf '[compose-demo] %s\n' "$*" >&2; }
step() {
    log "step '$STEP' done in $((SECONDS - STEP_T0)) s"
    STEP="$1"; STEP_T0=$SECONDS
    log "---- step: $STEP"
}
fail() { log "$*"; exit 1; }

# ---------------------------------------------------------------------------------- daemon
docker_answers() { docker info >/dev/null 2>&1; }

start_daemon() {
    if docker_answers; then
        log "using the Docker daemon that answers (not started here, left running)"
        return 0
    fi
    if [[ -S /var/run/docker.sock ]] && docker info 2>&1 | grep -q 'permission denied'; then
        fail "the Docker daemon refuses this user (add it to the docker group or use sudo)"
    fi
    ((EUID == 0)) || fail "no Docker daemon answers and only root can start one (sudo make compose-demo)"
    command -v dockerd >/dev/null || fail "dockerd not found: apt-get install -y docker.io docker-compose debootstrap"
    if [[ -f /var/run/docker.pid ]] && kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
        fail "a dockerd (pid $(cat /var/run/docker.pid)) runs but does not answer; not touching it"
    fi
    log "starting dockerd $DOCKERD_FLAGS (log: $CACHE/logs/dockerd.log)"
    # shellcheck disable=SC2086  # DOCKERD_FLAGS is a list of flags
    setsid dockerd $DOCKERD_FLAGS >"$CACHE/logs/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 1 120); do
        docker_answers && { log "dockerd answers (pid $DOCKERD_PID)"; return 0; }
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.5
    done
    tail -n 20 "$CACHE/logs/dockerd.log" >&2 || true
    fail "dockerd did not come up"
}

stop_daemon() {
    [[ -n "$DOCKERD_PID" ]] || return 0
    log "stopping the dockerd started here (pid $DOCKERD_PID)"
    kill -TERM "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 1 120); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$DOCKERD_PID" 2>/dev/null; then
        log "dockerd did not stop in 60 s: SIGKILL"
        kill -KILL "$DOCKERD_PID" 2>/dev/null || true
    fi
    wait "$DOCKERD_PID" 2>/dev/null || true
    DOCKERD_PID=""
}

# ---------------------------------------------------------------------------------- images
# build NAME LOGFILE docker-build-args...: quiet build, log tail on failure
build() {
    local name="$1" logfile="$CACHE/logs/build-$2.log"; shift 2
    local t=$SECONDS
    if ! nice -n 10 docker build --network host "$@" >"$logfile" 2>&1; then
        tail -n 30 "$logfile" >&2
        fail "building $name failed (log: $logfile)"
    fi
    log "built $name in $((SECONDS - t)) s"
}

official_images() {
    local img
    for img in superlink supernode superexec; do
        docker image inspect "flwr/$img:$FLWR_VERSION" >/dev/null 2>&1 && continue
        timeout 300 docker pull -q "flwr/$img:$FLWR_VERSION" >/dev/null 2>&1 || return 1
    done
}

port_free() {
    "$PY" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $1)) == 0)"
}

serve_wheelhouse() {
    local port="$WHEELHOUSE_PORT"
    if ! port_free "$port"; then
        port="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        log "port $WHEELHOUSE_PORT is taken: serving on $port (Docker's cached layers won't match)"
    fi
    setsid "$PY" -m http.server --bind 127.0.0.1 --directory "$CACHE/wheelhouse" "$port" \
        >"$CACHE/logs/wheelhouse-http.log" 2>&1 &
    HTTP_PID=$!
    for _ in $(seq 1 50); do port_free "$port" || { WHEELHOUSE_URL="http://127.0.0.1:$port/"; return 0; }; sleep 0.1; done
    fail "the wheelhouse server did not start"
}

build_images() {
    local mode="$IMAGES"
    if [[ "$mode" == auto ]]; then
        if official_images; then mode=official; else mode=local; fi
        log "official flwr/*:$FLWR_VERSION images: $([[ $mode == official ]] && echo available || echo 'cannot be pulled -> local build')"
    fi
    case "$mode" in
    official)
        export FLWR_REPOSITORY=flwr
        build "$PROJECT_IMAGE" project -t "$PROJECT_IMAGE" "$ROOT" ;;
    local)
        export FLWR_REPOSITORY=fl-attack-local
        local t=$SECONDS
        CACHE_DIR="$CACHE/base" "$ROOT/docker/make_base_image.sh" fl-attack-local/debian:bookworm
        log "base image ready in $((SECONDS - t)) s"; t=$SECONDS
        PIP="$PY -m pip" "$ROOT/docker/make_wheelhouse.sh" "$CACHE/wheelhouse" \
            2> >(grep -v '^WARNING: Location' >&2)
        log "wheelhouse ready in $((SECONDS - t)) s"
        serve_wheelhouse
        local target
        for target in superlink supernode superexec; do
            build "$FLWR_REPOSITORY/$target:$FLWR_VERSION" "flwr-$target" \
                -f "$ROOT/docker/flwr.Dockerfile" --target "$target" \
                --build-arg "FLWR_VERSION=$FLWR_VERSION" --build-arg "WHEELHOUSE_URL=$WHEELHOUSE_URL" \
                -t "$FLWR_REPOSITORY/$target:$FLWR_VERSION" "$ROOT/docker"
        done
        build "$PROJECT_IMAGE" project --build-arg "FLWR_REPOSITORY=$FLWR_REPOSITORY" \
            --build-arg "WHEELHOUSE_URL=$WHEELHOUSE_URL" -t "$PROJECT_IMAGE" "$ROOT"
        kill -TERM "$HTTP_PID" 2>/dev/null || true; wait "$HTTP_PID" 2>/dev/null || true
        HTTP_PID="" ;;
    esac
}

# ---------------------------------------------------------------------------------- federation
compose() { "${COMPOSE_CMD[@]}" -p "$PROJECT" -f "$ROOT/docker-compose.yml" -f "$CACHE/override.yml" "$@"; }

# chown_for_image PATH...: owned by the images' user (via a root container when not root here)
chown_for_image() {
    if ((EUID == 0)); then chown "$IMAGE_UID:$IMAGE_UID" "$@"; return; fi
    local p args=()
    for p in "$@"; do args+=(-v "$p:/mnt/$(basename "$p")"); done
    docker run --rm --user 0 --entrypoint chown "${args[@]}" "$PROJECT_IMAGE" \
        "$IMAGE_UID:$IMAGE_UID" $(for p in "$@"; do echo "/mnt/$(basename "$p")"; done)
}

federation_up() {
    (umask 077 && mkdir -p "$RUNS_DIR")
    RUNS_DIR="$(cd "$RUNS_DIR" && pwd)"
    chmod 700 "$RUNS_DIR"
    chown_for_image "$RUNS_DIR"
    export FL_ATTACK_RUNS_DIR="$RUNS_DIR" SUPERLINK_BIND=127.0.0.1
    if [[ -z "${SUPERLINK_PORT:-}" ]]; then
        SUPERLINK_PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    fi
    export SUPERLINK_PORT
    local tls_args=()
    if [[ "$TLS" == 1 ]]; then
        "$ROOT/scripts/generate_certs.sh" --clients "$NUM_CLIENTS" "$CACHE/certs"
        local keys=("$CACHE"/certs/superlink.key "$CACHE"/certs/supernode-*.key)
        chown_for_image "${keys[@]}"
        tls_args=(--tls ./.compose/certs)
    fi
    "$PY" "$ROOT/scripts/compose_override.py" --clients "$NUM_CLIENTS" "${tls_args[@]}" \
        -o "$CACHE/override.yml"
    compose down --remove-orphans -t 10 >/dev/null 2>&1 || true  # leftovers of an earlier run
    FED_UP=1
    compose up -d --no-build 2>&1 | sed 's/^/  /' >&2
    local fed="[superlink]\ndefault = \"docker\"\n\n[superlink.docker]\naddress = \"127.0.0.1:$SUPERLINK_PORT\"\n"
    if [[ "$TLS" == 1 ]]; then
        fed+="root-certificates = \"$CACHE/certs/ca.crt\"\n"
    else
        fed+="insecure = true\n"
    fi
    printf "$fed" >"$FLWR_HOME/config.toml"
    # `flwr ls` exits 0 when the SuperLink cannot be reached: read its "success" field
    for _ in $(seq 1 120); do
        if "$VENV/bin/flwr" ls docker --format json 2>/dev/null | "$PY" -c '
import json, sys
sys.exit(0 if json.load(sys.stdin).get("success") else 1)' 2>/dev/null; then
            log "SuperLink answers on 127.0.0.1:$SUPERLINK_PORT ($NUM_CLIENTS clients, TLS=$TLS)"
            return 0
        fi
        sleep 1
    done
    fail "the SuperLink did not answer on 127.0.0.1:$SUPERLINK_PORT"
}

teardown() {
    ((FED_UP)) || return 0
    compose down --remove-orphans -t 15 2>&1 | sed 's/^/  /' >&2 || true
    FED_UP=0
    local left
    left="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")"
    [[ -z "$left" ]] || { log "containers left: $left"; return 1; }
}

# ---------------------------------------------------------------------------------- run
run_and_check() {
    local run_config
    run_config="$(demo_run_config)"
    log "flwr run . docker --stream --run-config \"$run_config\""
    set +e
    (cd "$ROOT" && timeout "$TIMEOUT" "$VENV/bin/flwr" run . docker --stream \
        --run-config "$run_config") 2>&1 | tee "$WORK/flwr-run.log" >&2
    local rc=${PIPESTATUS[0]}
    set -e
    ((rc == 0)) || fail "flwr run exited with status $rc"

    step "run status"
    local status=""
    for _ in $(seq 1 30); do
        status="$("$VENV/bin/flwr" ls docker --format json 2>/dev/null | "$PY" -c '
import json, sys
runs = json.load(sys.stdin).get("runs", [])
print(runs[-1].get("status", "") if runs else "")')" || status=""
        [[ "$status" == finished* ]] && break
        sleep 2
    done
    log "run status: ${status:-unknown}"
    [[ "$status" == "finished:completed" ]] || fail "the run did not complete (status: ${status:-unknown})"

    step "audit summary"
    # read inside the container: the run directory is owner-only (uid 49999) on the host
    compose exec -T superexec-serverapp cat "/app/runs/$RUN_NAME/summary.json" >"$WORK/summary.json" \
        || fail "no summary.json in the run directory $RUNS_DIR/$RUN_NAME"
    compose exec -T superexec-serverapp test -s "/app/runs/$RUN_NAME/report.html" \
        || fail "no report.html in $RUNS_DIR/$RUN_NAME"
    "$PY" - "$WORK/summary.json" <<'EOF' || fail "the audit summary does not show a certified reconstruction"
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("status", "clients", "replies", "reconstructions", "certified", "psnr_mean")
print("[compose-demo] summary: " + ", ".join(f"{k}={s.get(k)}" for k in keys), file=sys.stderr)
sys.exit(0 if s.get("status") == "completed" and int(s.get("certified") or 0) >= 1 else 1)
EOF
}

# ---------------------------------------------------------------------------------- main
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if ((rc != 0)); then
        log "FAILED at step '$STEP' (exit status $rc)"
        if ((FED_UP)); then
            log "---- last log lines of the services ----"
            compose logs --no-color --tail 25 2>&1 | tail -n 150 >&2 || true
        fi
    fi
    local failed_step="$STEP"
    STEP="teardown"
    if ! teardown; then rc=1; failed_step="teardown"; fi
    if [[ -n "$HTTP_PID" ]]; then kill -TERM "$HTTP_PID" 2>/dev/null || true; wait "$HTTP_PID" 2>/dev/null || true; fi
    stop_daemon
    rm -rf "$WORK"
    if ((rc == 0)); then
        log "all steps passed in $((SECONDS - T0)) s"
    else
        log "compose demo failed (step '$failed_step'); total $((SECONDS - T0)) s"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

[[ "$NUM_CLIENTS" =~ ^[1-9][0-9]*$ ]] || fail "NUM_CLIENTS must be a positive integer"
[[ "$IMAGES" =~ ^(auto|official|local)$ ]] || fail "IMAGES must be auto, official or local, not '$IMAGES'"
[[ "$TLS" =~ ^[01]$ ]] || fail "TLS must be 0 or 1, not '$TLS'"
if [[ -n "${COMPOSE:-}" ]]; then
    read -r -a COMPOSE_CMD <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
    COMPOSE_CMD=(docker compose)
elif command -v docker-compose >/dev/null; then
    COMPOSE_CMD=(docker-compose)
else
    fail "neither 'docker compose' nor docker-compose found: apt-get install -y docker-compose"
fi

STEP="docker daemon"; log "---- step: $STEP"
start_daemon
step "images"
build_images
step "federation up"
federation_up
step "flwr run"
run_and_check
step "teardown"
teardown || fail "teardown left containers"
log "step 'teardown' done in $((SECONDS - STEP_T0)) s"
log "report: $RUNS_DIR/$RUN_NAME/report.html (owner uid $IMAGE_UID, mode 700: read it as root)"
echo "$RUNS_DIR/$RUN_NAME/report.html"
