# syntax=docker/dockerfile:1
# Production image of the Ballet Planner service.
#   docker build -t ballet-planner .
#   docker run -v ./planner.toml:/etc/ballet-planner/planner.toml:ro -p 50051:50051 ballet-planner
# Ports: 50051 gRPC (PlannerService, health, reflection), 9464 Prometheus metrics.

ARG PYTHON_IMAGE=python:3.11-slim

# Builder: wheels of the project and of every dependency, so the runtime stage installs
# offline and carries no compiler, pip cache or source tree.
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# .dockerignore lets in only what the wheel is built from.
COPY . .
RUN pip wheel --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# A fixed uid, so that volume permissions and Kubernetes' runAsNonRoot (which can only
# check a numeric USER) work without guessing.
RUN groupadd --system --gid 10001 planner \
 && useradd --system --uid 10001 --gid planner --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin planner \
 && mkdir -p /etc/ballet-planner
# Mounted rather than copied, so the wheels never become a layer of the image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels ballet-planner
USER 10001:10001
EXPOSE 50051 9464
# Readiness: exits 0 only while the service reports SERVING (SPEC section 8). It reads
# the same configuration as serve, so it asks the configured address (a wildcard host is
# asked on loopback) with the configured TLS settings.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["ballet-planner", "health", "--config", "/etc/ballet-planner/planner.toml"]
ENTRYPOINT ["ballet-planner"]
CMD ["serve", "--config", "/etc/ballet-planner/planner.toml"]
