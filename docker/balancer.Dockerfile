# The balancer in front of the compose gateways: Debian's HAProxy (no registry image
# needed) with docker/haproxy.cfg, which finds every `gateway` replica by Docker's DNS.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends haproxy tini \
    && rm -rf /var/lib/apt/lists/*
COPY haproxy.cfg /etc/baton/haproxy.cfg
EXPOSE 8000
ENTRYPOINT ["tini", "--"]
CMD ["haproxy", "-db", "-f", "/etc/baton/haproxy.cfg"]
