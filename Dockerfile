# The llamaswap sidecar image: `llamaswap serve` (gRPC for Envoy, admin HTTP).
#   docker build -t REGISTRY/llamaswap:0.1.0 .
# The Helm chart (charts/llamaswap) runs it as `llamaswap serve -c /etc/llamaswap/config.yaml`
# next to Envoy and llama-server, as the init containers that write Envoy's bootstrap
# (`llamaswap envoy-config`) and download the models (`llamaswap fetch-models`), and as the
# sidecar's startup probe (`llamaswap load-model`); it also serves the chart's `helm test` pod.
# It holds no Envoy: nothing in it runs one. Push it where your cluster pulls from and set
# the chart's sidecar.image.repository (the chart refuses to render without it).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what `pip install .` needs (see .dockerignore); the build tree is removed afterwards.
# The base package only: `llamaswap serve` runs no Envoy (the pod's Envoy is its own image) and
# no llama-server, so neither the `envoy` nor the `llama` extra is installed.
WORKDIR /build
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN pip install . \
    && rm -rf /build

# A fixed non-root user; the chart's securityContext runs as the same uid/gid.
RUN groupadd --system --gid 65532 llamaswap \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin llamaswap
USER 65532:65532
WORKDIR /

# gRPC (Envoy's ext_authz and access log) and admin HTTP (health, readiness, metrics, queue).
EXPOSE 9000 9090
ENTRYPOINT ["llamaswap"]
CMD ["serve", "-c", "/etc/llamaswap/config.yaml"]
