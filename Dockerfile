# Lucebox on an NVIDIA GPU: `docker build -t lucebox .` then
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models lucebox -m /models/MODEL.gguf
# The arguments after the image name are added to `lucebox serve --host 0.0.0.0 --port 8000`.
# The GPU driver comes from the host (NVIDIA Container Toolkit); the CUDA libraries torch, NVRTC and Triton
# need come with their wheels, so a slim Python base is enough.
FROM python:3.12-slim-bookworm

# Triton compiles its small launcher stubs with the system C compiler when a kernel is first used.
# (Not pinned: Debian's security updates replace these patch versions, and a pin would break the build.)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LUCEBOX_HOME=/cache

# torch first, from PyTorch's CUDA 13.0 index (PyPI's default torch wheel is a different CUDA build).
RUN pip install --index-url https://download.pytorch.org/whl/cu130 torch==2.13.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY lucebox_core ./lucebox_core
COPY plugins ./plugins
COPY backends ./backends
# lucebox-core, lucebox-qwen, lucebox-gemma4, lucebox-laguna and lucebox-cuda from this tree (the torch above is kept).
RUN pip install . ./plugins/qwen35 ./plugins/gemma4 ./plugins/laguna ./backends/cuda \
    && useradd --create-home --uid 1000 lucebox \
    && mkdir -p /models /cache \
    && chown lucebox:lucebox /cache

USER 1000
WORKDIR /home/lucebox
VOLUME ["/models", "/cache"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["lucebox", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
