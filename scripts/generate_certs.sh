#!/usr/bin/env bash
# TLS certificates for the docker-compose federation (the way Flower's Docker guide makes them:
# a private CA, one server certificate for the SuperLink; here also one per SuperNode, whose
# Runtime API serves that node's ClientApp SuperExec).
#
#   scripts/generate_certs.sh [--clients N] [DIR]     # defaults: N=2, DIR=<repo>/.compose/certs
#
# Writes into DIR (mode 700):
#   ca.key, ca.crt                   the CA (ca.key signs; keep it off the federation's hosts)
#   superlink.key, superlink.pem     SANs: superlink, localhost, 127.0.0.1, ::1, $SUPERLINK_SANS
#   supernode-<i>.key, .pem          SANs: supernode-<i>, for i = 0 .. N-1
# Keys are mode 600. Existing files are kept (a second call adds missing nodes only); remove DIR
# to start over. The containers run as uid 49999: the keys they mount must be readable by it
# (`sudo chown 49999 DIR/*.key`; scripts/compose_demo.sh does this).
#
# Environment (optional):
#   SUPERLINK_SANS   extra subjectAltName entries of the SuperLink certificate, for SuperNodes or
#                    a flwr CLI on other hosts, e.g. "DNS:fl.example.org,IP:10.0.0.5"
#   CERT_DAYS        validity in days (default 365)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLIENTS=2
if [[ "${1:-}" == "--clients" ]]; then CLIENTS="$2"; shift 2; fi
DIR="${1:-$ROOT/.compose/certs}"
DAYS="${CERT_DAYS:-365}"
[[ "$CLIENTS" =~ ^[1-9][0-9]*$ ]] || { echo "generate_certs: --clients must be >= 1" >&2; exit 2; }
command -v openssl >/dev/null || { echo "generate_certs: openssl not found" >&2; exit 1; }

log() { printf '[certs] %s\n' "$*" >&2; }
umask 077
mkdir -p "$DIR"
chmod 700 "$DIR"

if [[ ! -f "$DIR/ca.crt" ]]; then
    openssl genrsa -out "$DIR/ca.key" 4096 2>/dev/null
    openssl req -new -x509 -key "$DIR/ca.key" -sha256 -days "$DAYS" \
        -subj "/O=fl-attack/CN=fl-attack federation CA" -out "$DIR/ca.crt"
    log "CA: $DIR/ca.crt"
fi

# server NAME SANS: NAME.key + NAME.pem signed by the CA, with subjectAltName SANS
server() {
    local name="$1" sans="$2"
    [[ -f "$DIR/$name.pem" ]] && return 0
    openssl genrsa -out "$DIR/$name.key" 4096 2>/dev/null
    openssl req -new -key "$DIR/$name.key" -subj "/O=fl-attack/CN=$name" -out "$DIR/$name.csr"
    printf 'subjectAltName = %s\nextendedKeyUsage = serverAuth\n' "$sans" >"$DIR/$name.ext"
    openssl x509 -req -in "$DIR/$name.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" \
        -CAcreateserial -out "$DIR/$name.pem" -days "$DAYS" -sha256 \
        -extfile "$DIR/$name.ext" 2>/dev/null
    rm -f "$DIR/$name.csr" "$DIR/$name.ext"
    log "$name: $DIR/$name.pem ($sans)"
}

server superlink "DNS:superlink,DNS:localhost,IP:127.0.0.1,IP:::1${SUPERLINK_SANS:+,$SUPERLINK_SANS}"
for ((i = 0; i < CLIENTS; i++)); do
    server "supernode-$i" "DNS:supernode-$i"
done
chmod 644 "$DIR"/*.pem "$DIR/ca.crt"
chmod 600 "$DIR"/*.key
