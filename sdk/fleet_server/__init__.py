"""The fleet server (``edgepack fleet serve``): a persistent control plane for a fleet.

One module per concern; the pure decisions are separate from the I/O around them:

| module | job |
| --- | --- |
| :mod:`.db` | the tables (SQLAlchemy Core), engines for SQLite (WAL) and PostgreSQL, write transactions |
| :mod:`.migrations` | Alembic environment and versions, run at start (:func:`.schema_upgrade.migrate`) |
| :mod:`.ingest` | the MQTT consumer (messages parsed by :mod:`edgepack_core.protocol.messages`): state and |
| | jobs on a persistent session acknowledged after commit, |
| | telemetry through an MQTT 5 shared subscription; batched writes; counters |
| :mod:`.retention` | pure bucketing and rollups; the pruning job (raw window, rollups beyond) |
| :mod:`.rollouts` | pure: the rollout state machine (:func:`~.rollouts.transition`), the next step and its gates |
| :mod:`.driver` | the loop that advances rollouts under a leader lease; commands recorded, then published |
| | it also reconciles every device to its target (:mod:`.desired`) |
| :mod:`.targets` | pure: targets, effective target (device > group > fleet), reconcile: converged, send, wait |
| :mod:`.desired` | targets read and written (audited), each device's decision from the database |
| :mod:`.artifacts` | the content-addressed store: bounded uploads verified before storing, Range downloads |
| :mod:`.auth` | bearer tokens from a file, compared in constant time |
| :mod:`.audit` | every write recorded: who, what, when, outcome |
| :mod:`.api` | the REST API (Starlette), its one error shape, the ``/ui/`` mount |
| :mod:`.targets_api` | the API's routes of the desired state (targets read and set, staged changes) |
| :mod:`.openapi` | the OpenAPI 3.1 description of the API |
| :mod:`.queries` | the API's reads and writes on the tables (rollouts, artifacts) |
| :mod:`.device_queries` | the API's reads and writes on the devices (list, groups, decommission, telemetry) |
| :mod:`.server` | :class:`~.server.ServerConfig` and :func:`~.server.serve`: the wiring |
| :mod:`.client` | the CLI's HTTP client (standard library only: ``rollout`` needs no server extra) |

Importing this package imports nothing: the client must work without the ``server`` extra.
"""
