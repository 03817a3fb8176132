# Redis for the compose cluster, from Debian's package (no registry image needed).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server tini \
    && rm -rf /var/lib/apt/lists/*
EXPOSE 6379
ENTRYPOINT ["tini", "--"]
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]
