# One image for every role (the command picks the role; see docker-compose.yml).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    BATON_CACHE_DIR=/opt/baton/cache

WORKDIR /opt/baton/src
# A C compiler: the native decode-attention kernel is compiled for the host CPU
# on first start (without one, engines fall back to the slower torch path).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# CPU torch first (a plain `pip install torch` would pull the multi-GB CUDA build);
# for a GPU image, install the CUDA build of torch here instead.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install .

# The model is pulled (and converted) at image build, so containers start without network.
RUN baton model pull

EXPOSE 8000 8100 8200 8300 8301
CMD ["baton", "up"]
