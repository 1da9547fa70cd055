# The Edgepack device agent (the `edgepack-agent` distribution only: no onnx, click or sdk code).
#
#   docker build -f deploy/docker/agent.Dockerfile --build-arg BASE=python:3.11-slim -t edgepack-agent CONTEXT
#
# CONTEXT holds `wheels/`: edgepack-agent's wheel and its dependencies' wheels
# (tools/docker_context.sh makes it), so the build installs offline. Runs as uid 10001 with
# the store on a volume; HEALTHCHECK asks the agent's /healthz with Python's urllib (healthy
# while a model serves: 200; "no model" is 503). See docs/docker.md.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
COPY wheels/ /tmp/wheels/
RUN python3 -m venv /opt/edgepack \
 && /opt/edgepack/bin/python -m pip install --no-cache-dir --no-index --find-links /tmp/wheels \
      --disable-pip-version-check -q edgepack-agent \
 && /opt/edgepack/bin/python -m pip uninstall -q -y pip setuptools

FROM ${BASE}
# The user exists by uid alone in /etc/passwd lines, so any Debian-like base works without useradd.
RUN echo "edgepack:x:10001:10001:Edgepack agent:/var/lib/edgepack:/usr/sbin/nologin" >> /etc/passwd \
 && echo "edgepack:x:10001:" >> /etc/group \
 && mkdir -p /var/lib/edgepack /etc/edgepack \
 && chown 10001:10001 /var/lib/edgepack && chmod 0750 /var/lib/edgepack
COPY --from=build /opt/edgepack /opt/edgepack
ENV PATH=/opt/edgepack/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONUNBUFFERED=1 \
    EDGEPACK_HEALTH_URL=http://127.0.0.1:8750/healthz
USER 10001:10001
WORKDIR /var/lib/edgepack
# installed models, the job journal, the telemetry outbox: kept across restarts and image updates
VOLUME ["/var/lib/edgepack"]
EXPOSE 8750
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["/opt/edgepack/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['EDGEPACK_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["edgepack-agent"]
# agent.yaml: store /var/lib/edgepack and api.listen 0.0.0.0:8750 (the health check's address)
CMD ["run", "--config", "/etc/edgepack/agent.yaml"]
