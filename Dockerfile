# SuperExec image with fl-attack installed, for both sides of the docker-compose deployment:
#   * server side: runs the audited ServerApp (AuditingStrategy + the SPEAR++ attack);
#   * client side: runs the ClientApp (FedSGD / FedAvg / Opacus DP-SGD).
# Each run's app code arrives with the run (the FAB that `flwr run` ships), but its components
# (`fl_attack_flwr.app.server_app:app`, `fl_attack_flwr.clients.client_app:app`) and the libraries
# they import are resolved in this image: the project is installed here (not editable).
#
# Two ways to build it (docs/deployment.md):
#   connected host (default): FROM Flower's official flwr/superexec image, torch from
#     TORCH_INDEX (the CPU wheels), the rest from PyPI:
#       docker build -t fl-attack-superexec:latest .
#   air-gapped host: FROM the local equivalent of flwr/superexec (docker/flwr.Dockerfile) and
#     every wheel from the wheelhouse of docker/make_wheelhouse.sh, served over HTTP on the
#     build host (scripts/compose_demo.sh does all of this):
#       docker build --network host --build-arg FLWR_REPOSITORY=fl-attack-local \
#           --build-arg WHEELHOUSE_URL=http://127.0.0.1:PORT/ -t fl-attack-superexec:latest .
#
# GPU hosts: the attack uses CUDA when it is available. Build with a CUDA index, e.g.
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128, and give the
# superexec-serverapp service a GPU (docker-compose.yml). A wheelhouse holding PyPI's torch
# (the CUDA build) gives a GPU-capable image as it is.
ARG FLWR_VERSION=1.41.0
ARG FLWR_REPOSITORY=flwr
FROM ${FLWR_REPOSITORY}/superexec:${FLWR_VERSION}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELHOUSE_URL=

# Dependencies first (the largest layer, changes least). The base image's user owns the
# virtualenv /python/venv, so everything installs as that user (no root in the image).
COPY docker/requirements.txt docker/requirements-nodeps.txt /tmp/requirements/
RUN set -eu; \
    pip_install() { python -m pip install --no-cache-dir --disable-pip-version-check "$@"; }; \
    if [ -n "$WHEELHOUSE_URL" ]; then \
        pip_install --no-index --find-links "$WHEELHOUSE_URL" -r /tmp/requirements/requirements.txt; \
        pip_install --no-index --find-links "$WHEELHOUSE_URL" --no-deps \
            -r /tmp/requirements/requirements-nodeps.txt; \
    else \
        pip_install --index-url "$TORCH_INDEX" \
            $(grep -E '^(torch|torchvision)==' /tmp/requirements/requirements.txt); \
        pip_install -r /tmp/requirements/requirements.txt; \
        pip_install --no-deps -r /tmp/requirements/requirements-nodeps.txt; \
    fi

# The project itself: `fl_attack` and `fl_attack_flwr` (pyproject.toml maps strategies/ and
# clients/ to it). Dependencies are installed above; flwr stays the base image's.
COPY --chown=app:app pyproject.toml README.md /tmp/fl-attack/
COPY --chown=app:app fl_attack /tmp/fl-attack/fl_attack
COPY --chown=app:app strategies /tmp/fl-attack/strategies
COPY --chown=app:app clients /tmp/fl-attack/clients
RUN set -eu; \
    if [ -n "$WHEELHOUSE_URL" ]; then set -- --no-index --find-links "$WHEELHOUSE_URL"; fi; \
    python -m pip install --no-cache-dir --disable-pip-version-check --no-deps "$@" /tmp/fl-attack \
 && rm -rf /tmp/fl-attack \
 && python -c "import fl_attack, fl_attack_flwr.app.server_app, fl_attack_flwr.clients.client_app"

# Never install app dependencies at run time (offline clusters; reproducibility).
ENV FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app
ENTRYPOINT ["flower-superexec"]
