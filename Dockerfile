# syntax=docker/dockerfile:1
# Narwhal's container image: the daemon and its commands in a venv, run as user narwhal.
#
#   docker build -t narwhal --build-arg NARWHAL_VERSION=0.1.0 .
#   docker run -d --name narwhal -p 8000:8000 \
#       -v /srv/narwhal:/etc/narwhal:ro -v narwhal-state:/var/lib/narwhal narwhal
#   docker exec narwhal narwhalctl --config /etc/narwhal/narwhal.json state
#
# The image ships no config: mount a folder holding narwhal.json at /etc/narwhal. Inside
# a container, loopback is the container's own, so that file needs:
#   listen.host "0.0.0.0"   (the published client port; the default 127.0.0.1 is unreachable);
#   engine URLs the container can reach (not 127.0.0.1 unless --network host);
#   ctl.socket "/run/narwhal/narwhal.sock", profiles.path under /var/lib/narwhal (both ours).
# admin.host stays 127.0.0.1 (the default) unless Prometheus scrapes from outside: then
# "0.0.0.0" with admin.token_file set, and publish admin.port (8001) as well.
# The build context has no .git, so the version is NARWHAL_VERSION (default: 0.0).
# With the tokenizer extra, so that engine.tokenizer_path (counts and exact cache keys in
# the router) works in the image as from a clone.

ARG PYTHON=3.12

FROM python:${PYTHON}-slim AS build
ARG NARWHAL_VERSION=""
WORKDIR /src
COPY pyproject.toml README.md ./
COPY narwhal ./narwhal
RUN if [ -n "$NARWHAL_VERSION" ]; then \
        export SETUPTOOLS_SCM_PRETEND_VERSION_FOR_NARWHAL="$NARWHAL_VERSION"; \
    fi \
    && python -m venv /opt/narwhal/.venv \
    && /opt/narwhal/.venv/bin/pip install --no-cache-dir --disable-pip-version-check '.[tokenizer]'

FROM python:${PYTHON}-slim
# User narwhal (uid 10001). The same paths as the systemd unit (conf/narwhal.service): /opt/narwhal/.venv,
# /etc/narwhal, /run/narwhal (0700, the control socket) and /var/lib/narwhal.
RUN groupadd --system --gid 10001 narwhal \
    && useradd --system --uid 10001 --gid narwhal --home-dir /var/lib/narwhal --shell /usr/sbin/nologin narwhal \
    && install -d -o narwhal -g narwhal -m 0700 /run/narwhal /var/lib/narwhal \
    && install -d -m 0755 /etc/narwhal
COPY --from=build /opt/narwhal/.venv /opt/narwhal/.venv
COPY conf/container/healthcheck.py /opt/narwhal/healthcheck.py
ENV PATH=/opt/narwhal/.venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    NARWHAL_CONFIG=/etc/narwhal/narwhal.json
# Numeric, so that runAsNonRoot-style checks can see it is not root.
USER 10001:10001
WORKDIR /var/lib/narwhal
EXPOSE 8000
# /health on the client port: 503 while degraded (no usable engine pair) or shutting down.
# The start period covers the engine probes at startup.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/opt/narwhal/healthcheck.py"]
# SIGTERM drains in-flight requests for recovery.shutdown_grace_s (30 s by default):
# stop with `docker stop -t 40`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["narwhal"]
CMD ["serve", "--config", "/etc/narwhal/narwhal.json"]
