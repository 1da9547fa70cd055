# A stand-in for the postgres:16 image, made offline from the check's Debian services base
# (tools/docker_check.sh): the same interface deploy/docker/compose.yaml uses (POSTGRES_USER,
# POSTGRES_DB, POSTGRES_PASSWORD_FILE, the data folder /var/lib/postgresql/data, pg_isready).
ARG BASE
FROM ${BASE}
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/bin:/usr/bin:/bin PGDATA=/var/lib/postgresql/data
VOLUME ["/var/lib/postgresql/data"]
EXPOSE 5432
ENTRYPOINT ["/bin/sh", "/usr/local/bin/docker-entrypoint.sh"]
CMD ["postgres"]
