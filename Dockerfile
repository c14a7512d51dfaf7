# The service's images, one per kind of host (docs/operating.md, "Containers"):
#
#   docker build --target cpu -t chattts-service:cpu .   torch's CPU build, a C compiler for the int4 step
#   docker build --target gpu -t chattts-service:gpu .   PyPI's CUDA torch: CUDA 13's libraries come as wheels,
#                                                        the host needs only an NVIDIA driver of the 580 series
#                                                        or later and the NVIDIA Container Toolkit
#
# Both install from the hashed locks, run as the user `tts`, keep the model cache on the /cache volume, and
# take one argument: a Procfile process name (web, worker, webhooks, dashboard, ...) or `all` for one
# container that runs them together (scripts/entrypoint). compose.yaml runs them with a Redis.
#
# Build arguments:
#   BASE_IMAGE       the Debian 12 image to start from (a mirror's or a local copy stands in)
#   TORCH_INDEX_URL  where torch's CPU build comes from (cpu target): PyTorch's CPU index or a mirror of it
#   PIP_CERT         a CA bundle for pip, mounted into the build, where a proxy re-signs the package index
#   SOURCE_URL       the repository the image is built from: TTS_SOURCE_URL's default, shown on the page
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS base
ARG DEBIAN_FRONTEND=noninteractive
# python3 (3.11) for the locks; gcc builds engines/q4step.c, the worker's int4 step on a CPU; tini is PID 1,
# passing signals on and reaping children; redis-server for `all` when REDIS_URL does not answer.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv gcc libc6-dev tini \
       redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 tts && useradd --create-home --uid 10001 --gid 10001 tts \
    && mkdir -p /app /cache \
    && chown tts:tts /cache \
    && ln -s /cache /app/.cache
WORKDIR /app
# /cache (a volume): the hub's weights (HF_HOME), the tiny checkpoint the worker falls back to where the
# weights cannot be had (as `make run` does; set TTS_FALLBACK_MODEL_PATH= to stop instead), and `all`'s
# private Redis. `.cache` in /app points there, as `make run`'s does in a checkout.
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface \
    TTS_FALLBACK_MODEL_PATH=/cache/tiny-model
ARG SOURCE_URL=""
ENV TTS_SOURCE_URL=${SOURCE_URL}
LABEL org.opencontainers.image.title="chattts-service" \
      org.opencontainers.image.licenses="AGPL-3.0-or-later" \
      org.opencontainers.image.source=${SOURCE_URL}
VOLUME /cache
EXPOSE 8000 9181
# web: /healthz; worker and webhooks: an rq worker of the container registered in Redis (the first start
# downloads the weights, hence the long start period); processes/health.py says what each process is checked by.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 CMD ["python", "-m", "processes.health"]
ENTRYPOINT ["tini", "--", "/app/scripts/entrypoint"]
CMD ["all"]

FROM base AS cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_CERT=""
COPY requirements-run.txt /app/
# PyPI's torchaudio is a CUDA build whose native libraries do not load beside torch 2.13; ChatTTS uses only
# its pure-Python parts (docs/gpu.md, "torchaudio").
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /app/.venv \
    && /app/.venv/bin/pip install -q --require-hashes ${PIP_CERT:+--cert "$PIP_CERT"} \
       --extra-index-url "$TORCH_INDEX_URL" -r requirements-run.txt \
    && rm -f /app/.venv/lib/python3*/site-packages/torchaudio/lib/*.so
COPY . /app
USER 10001:10001

FROM base AS gpu
ARG PIP_CERT=""
COPY requirements-worker.txt /app/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /app/.venv \
    && /app/.venv/bin/pip install -q --require-hashes ${PIP_CERT:+--cert "$PIP_CERT"} -r requirements-worker.txt \
    && rm -f /app/.venv/lib/python3*/site-packages/torchaudio/lib/*.so
# What the NVIDIA Container Toolkit mounts: the driver's CUDA library, and nvidia-smi, which the worker's
# launcher lists the GPUs with (worker.py --gpus all: one worker per GPU it is given).
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY . /app
USER 10001:10001
