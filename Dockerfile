# syntax=docker/dockerfile:1
# Production image of the Ballet Planner service; configured by environment variables
# alone (BALLET_PLANNER__<TABLE>__<KEY>, docs/configuration.md), no file required.
# It holds the planner alone; the `demo` target adds the devstack (`ballet-planner dev`).
#   docker build -t ballet-planner .
#   docker run -p 50051:50051 -p 9464:9464 --env-file planner.env \
#     -v ./secrets:/var/run/secrets/ballet-planner:ro ballet-planner
# The README's "The container image" section shows a complete planner.env.
# Ports: 50051 gRPC (PlannerService, health, reflection), 9464 Prometheus metrics.

ARG PYTHON_IMAGE=python:3.11-slim

# Builder: wheels of the planner, the devstack and every dependency, so the later stages
# install offline and carry no compiler, pip cache or source tree.
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# .dockerignore lets in only what the wheels are built from.
COPY . .
RUN pip wheel --wheel-dir /wheels . ./devstack

FROM ${PYTHON_IMAGE} AS planner
# The listening addresses are every interface (the container's network is its boundary);
# that needs a key set (auth.jwks_path) and TLS or server.insecure, so the image never
# serves in dev mode by accident: without them it stops with a message naming the key.
# The data directory is the working directory, writable by the service's user.
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    BALLET_PLANNER__DATA_DIR=/var/lib/ballet-planner \
    BALLET_PLANNER__SERVER__ADDRESS=0.0.0.0:50051 \
    BALLET_PLANNER__SERVER__METRICS_ADDRESS=0.0.0.0:9464
# A fixed uid, so that volume permissions and Kubernetes' runAsNonRoot (which can only
# check a numeric USER) work without guessing.
RUN groupadd --system --gid 10001 planner \
 && useradd --system --uid 10001 --gid planner --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin planner \
 && mkdir -p /var/lib/ballet-planner \
 && chown 10001:10001 /var/lib/ballet-planner \
 && chmod 0750 /var/lib/ballet-planner
# Mounted rather than copied, so the wheels never become a layer of the image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels ballet-planner
WORKDIR /var/lib/ballet-planner
VOLUME ["/var/lib/ballet-planner"]
USER 10001:10001
EXPOSE 50051 9464
# Readiness: exits 0 only while the service reports SERVING (docs/spec/operations.md). It reads
# the same environment as serve, so it asks the configured address (a wildcard host is
# asked on loopback) with the configured TLS settings.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["ballet-planner", "health"]
ENTRYPOINT ["ballet-planner"]
CMD ["serve"]

# A demo image: the planner with its devstack (`docker build --target demo`), running
# `dev` on the container's loopback; chat from inside it:
#   docker run -d --name planner-demo ballet-planner-demo
#   docker exec -it planner-demo ballet-planner chat --user alice
FROM planner AS demo
USER root
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels ballet-devstack
USER 10001:10001
ENV BALLET_PLANNER__SERVER__ADDRESS=127.0.0.1:50051 \
    BALLET_PLANNER__SERVER__METRICS_ADDRESS=127.0.0.1:9464
CMD ["dev"]

# The production image (the default target): the planner alone.
FROM planner AS runtime
