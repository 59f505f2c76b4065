# Prometheus from Debian's package, for machines that cannot pull prom/prometheus
# (the Compose profile `observability` defaults to the official image):
#
#   docker build -f deploy/monitoring/prometheus.Dockerfile \
#     --build-arg BASE_IMAGE=debian:bookworm-slim -t openengine-prometheus:local deploy/monitoring
#   OPENENGINE_PROMETHEUS_IMAGE=openengine-prometheus:local docker compose --profile observability up -d --wait
#
# It behaves like the official image where the Compose file relies on it: the
# binary is the entrypoint, promtool is on PATH, data lives in /prometheus, and
# it runs as nobody (65534).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# The base image's Debian release fixes the version: no pin to go stale.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus \
    && chown nobody:nogroup /prometheus
# nobody (numeric, as in the official image)
USER 65534
WORKDIR /prometheus
VOLUME ["/prometheus"]
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
