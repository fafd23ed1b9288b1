#!/usr/bin/env bash
# Wheelhouse for the air-gapped image builds: every wheel the Flower images and the project image
# install, downloaded on a host that reaches a package index (then carried to the build host).
#
#   docker/make_wheelhouse.sh [DIR]          # default DIR: <repo>/.compose/wheelhouse
#
# Contents: docker/requirements.txt with its dependencies, docker/requirements-nodeps.txt
# without, and setuptools (to build the project inside the image). The wheels are for the
# images' Python (CPython 3.11 on Debian 12, glibc 2.36, x86_64), whatever the downloading host
# runs, so only binary wheels are taken.
#
# torch: the CPU build from TORCH_INDEX (default https://download.pytorch.org/whl/cpu, no CUDA
# libraries) is tried first; where that index cannot be reached, torch comes from the default
# index (on PyPI the Linux wheel is the CUDA build: ~3 GB of wheels with the nvidia-* libraries,
# ~5 GB installed; the image then also runs the attack on a GPU). TORCH_INDEX= (empty) skips the
# try.
#
# A complete wheelhouse is marked by DIR/.complete (a hash of the inputs): a second call with the
# same inputs does nothing. PIP (default: python3 -m pip) is the pip that downloads.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.compose/wheelhouse}"
TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
read -r -a PIP <<<"${PIP:-python3 -m pip}"
REQ="$ROOT/docker/requirements.txt"
REQ_NODEPS="$ROOT/docker/requirements-nodeps.txt"
BUILD_REQ=("setuptools>=77" "wheel")

log() { printf '[wheelhouse] %s\n' "$*" >&2; }

# Binary wheels for the images' interpreter and C library, not the host's.
TARGET=(--only-binary=:all: --implementation cp --python-version 3.11)
for glibc in $(seq 36 -1 17); do TARGET+=(--platform "manylinux_2_${glibc}_x86_64"); done
TARGET+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64
         --platform manylinux1_x86_64 --platform linux_x86_64)

stamp="$( (cat "$REQ" "$REQ_NODEPS"; echo "${TARGET[*]} ${BUILD_REQ[*]}") | sha256sum | cut -c1-16)"
stamp+=" torch-index=$TORCH_INDEX"
if [[ -f "$DIR/.complete" && "$(cat "$DIR/.complete")" == "$stamp" ]]; then
    log "$DIR is complete ($(du -sh "$DIR" | cut -f1))"
    exit 0
fi
mkdir -p "$DIR"
rm -f "$DIR/.complete"

torch_pins=()
while read -r line; do
    [[ "$line" =~ ^(torch|torchvision)== ]] && torch_pins+=("$line")
done <"$REQ"
if [[ -n "$TORCH_INDEX" ]]; then
    log "torch: trying the CPU build from $TORCH_INDEX (${torch_pins[*]})"
    # Success means a +cpu wheel arrived (a pip configuration may add other indexes or
    # find-links, which would satisfy the pins with another build).
    "${PIP[@]}" download -q --no-deps -d "$DIR/.cpu" --index-url "$TORCH_INDEX" "${TARGET[@]}" \
        --retries 1 --timeout 20 "${torch_pins[@]}" >"$DIR/.torch-index.log" 2>&1 || true
    if compgen -G "$DIR/.cpu/torch-*+cpu-*.whl" >/dev/null; then
        mv "$DIR"/.cpu/*+cpu-*.whl "$DIR"/
        log "torch: CPU build downloaded"
    else
        why="$(grep -m1 -oE 'Name or service not known|Connection refused|timed out|CERTIFICATE_VERIFY_FAILED' "$DIR/.torch-index.log" || echo 'no +cpu wheel, see .torch-index.log')"
        log "torch: no CPU build from $TORCH_INDEX ($why): the default index's torch goes" \
            "into the wheelhouse (on PyPI: the CUDA build)"
    fi
    rm -rf "$DIR/.cpu"
fi
# With --find-links on the wheelhouse, a CPU torch already there (2.14.1+cpu sorts above 2.14.1)
# is what the resolver picks, and its dependency list has no nvidia-* packages.
log "pip download -r docker/requirements.txt (+ setuptools)"
"${PIP[@]}" download -q -d "$DIR" --find-links "$DIR" "${TARGET[@]}" -r "$REQ" "${BUILD_REQ[@]}"
log "pip download --no-deps -r docker/requirements-nodeps.txt"
"${PIP[@]}" download -q --no-deps -d "$DIR" "${TARGET[@]}" -r "$REQ_NODEPS"
echo "$stamp" >"$DIR/.complete"
torch_wheel="$(cd "$DIR" && ls torch-*.whl)"
log "$DIR: $(find "$DIR" -name '*.whl' | wc -l) wheels, $(du -sh "$DIR" | cut -f1); torch wheel: $torch_wheel"
