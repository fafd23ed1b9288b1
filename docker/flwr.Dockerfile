# Local equivalents of Flower's official images flwr/superlink, flwr/supernode and flwr/superexec
# (github.com/flwrlabs/flower, framework/docker/), for hosts that cannot pull from Docker Hub.
# Same layout as the official base image: Python packages in the virtualenv /python/venv (owned
# by the user), the non-root user `app` (uid 49999) with home and working directory /app, the
# same environment variables, and one entry point per target:
#
#   superlink  -> flower-superlink      supernode -> flower-supernode
#   superexec  -> flower-superexec
#
# The base is a Debian 12 image made by docker/make_base_image.sh (debootstrap, no registry);
# Python is Debian's python3 (3.11). flwr comes from the wheelhouse of docker/make_wheelhouse.sh
# served over HTTP on the build host (WHEELHOUSE_URL, build with --network host); without
# WHEELHOUSE_URL it comes from the package index.
#
#   docker build --network host -f docker/flwr.Dockerfile --target superlink \
#       --build-arg WHEELHOUSE_URL=http://127.0.0.1:PORT/ -t fl-attack-local/superlink:1.41.0 docker
#
# scripts/compose_demo.sh builds all three when the official images cannot be pulled.
ARG BASE_IMAGE=fl-attack-local/debian:bookworm

FROM ${BASE_IMAGE} AS python
ARG FLWR_VERSION=1.41.0
ARG WHEELHOUSE_URL=
RUN set -eu; \
    if [ -n "$WHEELHOUSE_URL" ]; then set -- --no-index --find-links "$WHEELHOUSE_URL"; fi; \
    python3 -m venv /python/venv; \
    /python/venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check "$@" \
        "flwr==${FLWR_VERSION}"

FROM ${BASE_IMAGE} AS base
RUN useradd --no-create-home --home-dir /app -c "" --uid 49999 app \
 && mkdir -p /app \
 && chown -R app:app /app
COPY --from=python --chown=app:app /python/venv /python/venv
ENV PATH=/python/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONIOENCODING=UTF-8 \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8
WORKDIR /app
USER app
ENV HOME=/app

FROM base AS superlink
ENTRYPOINT ["flower-superlink"]

FROM base AS supernode
ENTRYPOINT ["flower-supernode"]

FROM base AS superexec
ENTRYPOINT ["flower-superexec"]
