# The Edgepack fleet server (`edgepack fleet serve`: the `edgepack` distribution with the
# server's dependencies, without the packager's onnx, scikit-learn and sympy).
#
#   docker build -f deploy/docker/server.Dockerfile --build-arg BASE=python:3.11-slim -t edgepack-server CONTEXT
#
# CONTEXT holds `wheels/` with server-requirements.txt and every wheel it needs
# (tools/docker_context.sh makes it), so the build installs offline. Runs as uid 10001; the
# database (SQLite) and the artifact store are volumes; HEALTHCHECK asks /healthz with Python's
# urllib. See docs/docker.md.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
COPY wheels/ /tmp/wheels/
RUN python3 -m venv /opt/edgepack \
 && /opt/edgepack/bin/python -m pip install --no-cache-dir --no-index --find-links /tmp/wheels \
      --disable-pip-version-check -q -r /tmp/wheels/server-requirements.txt \
 && /opt/edgepack/bin/python -m pip uninstall -q -y pip setuptools

FROM ${BASE}
RUN echo "edgepack:x:10001:10001:Edgepack fleet server:/var/lib/edgepack-fleet:/usr/sbin/nologin" >> /etc/passwd \
 && echo "edgepack:x:10001:" >> /etc/group \
 && mkdir -p /var/lib/edgepack-fleet/db /var/lib/edgepack-fleet/artifacts \
 && chown -R 10001:10001 /var/lib/edgepack-fleet && chmod -R 0700 /var/lib/edgepack-fleet
COPY --from=build /opt/edgepack /opt/edgepack
ENV PATH=/opt/edgepack/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONUNBUFFERED=1 \
    EDGEPACK_FLEET_DB=sqlite:////var/lib/edgepack-fleet/db/fleet.db \
    EDGEPACK_HEALTH_URL=http://127.0.0.1:8760/healthz
USER 10001:10001
WORKDIR /var/lib/edgepack-fleet
# the SQLite database (unused with PostgreSQL) and the artifact store
VOLUME ["/var/lib/edgepack-fleet/db", "/var/lib/edgepack-fleet/artifacts"]
EXPOSE 8760
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["/opt/edgepack/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['EDGEPACK_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["edgepack"]
# broker, keys and tokens come from the deployment (deploy/docker/compose.yaml)
CMD ["fleet", "serve", "--help"]
