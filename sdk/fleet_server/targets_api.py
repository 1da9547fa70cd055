"""The API's routes for targets (the desired state): the fleet's, a group's and a device's target
read and set, a staged change as a rollout carrying it, a device's effective target. Split out of
:mod:`.api` (wired into :func:`.api.build_app` behind its guard, as :mod:`.users_api` is); what
a target change implies is sent by the reconciler (:mod:`.desired`), not here.
"""

from __future__ import annotations

import time
from dataclasses import replace

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.schema import Validator
from sdk.errors import ApiError
from sdk.fleet_server import desired, queries
from sdk.fleet_server.api import ApiContext, Handler
from sdk.fleet_server.http_input import Params, _path_id, _remote, _validate, read_json
from sdk.fleet_server.rollouts import Gates, check_gates

_TARGET_VALIDATOR = Validator(desired.TARGET_REQUEST_SCHEMA, document="target")


class TargetRoutes:
    """Handlers taking ``(request, actor)``, run behind :meth:`.api.Routes.guard`."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context
        self.database = context.database

    @staticmethod
    def _scope(request: Request, scope: str) -> str:
        if scope == "fleet":
            return ""
        if scope == "group":
            group = request.path_params["group"]
            if not is_valid_id(group):
                raise ApiError(404, "not_found", "no such group")
            return str(group)
        return _path_id(request, "device_id")

    async def targets(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        return JSONResponse(await run_in_threadpool(lambda: desired.targets_doc(self.database, self.context.view())))

    def target(self, scope: str) -> Handler:
        async def show(request: Request, _actor: str) -> Response:
            Params(request, set())
            name = self._scope(request, scope)
            doc = await run_in_threadpool(desired.scope_doc, self.database, scope, name)
            if scope == "group":
                doc["devices"] = (await run_in_threadpool(
                    lambda: desired.targets_doc(self.database, self.context.view(), group=name)))["states"]
            return JSONResponse(doc)
        return show

    def set_target(self, scope: str) -> Handler:
        async def put(request: Request, actor: str) -> Response:
            Params(request, set())
            name = self._scope(request, scope)
            body = await read_json(request)
            _validate(_TARGET_VALIDATOR, body)
            change = desired.parse_change(body, scope)
            remote = _remote(request)
            if change.staged is None:
                await run_in_threadpool(lambda: desired.set_target(self.database, scope, name, change, actor=actor,
                                                                   remote=remote))
            else:
                await run_in_threadpool(self._stage, scope, name, change, actor, remote)
            return self.context.answer_then_wake(await run_in_threadpool(desired.scope_doc, self.database, scope,
                                                                         name))
        return put

    def _stage(self, scope: str, name: str, change: desired.TargetChange, actor: str, remote: str) -> None:
        """A staged change: a rollout over the devices that need it (force_downgrade: the operator
        chose the target), carrying the change, which the driver applies when the rollout
        succeeds. With no device to move, the change is applied at once."""
        staged = change.staged
        assert staged is not None
        devices = desired.staged_devices(self.database, scope, name, change)
        if not devices:
            desired.set_target(self.database, scope, name, replace(change, staged=None), actor=actor, remote=remote)
            return
        gates = check_gates(Gates(min_success_share=staged.min_success_share, soak_s=staged.soak_s,
                                  wave_timeout_s=staged.wave_timeout_s, max_error_rate=staged.max_error_rate))
        request = queries.RolloutRequest(artifact=next(iter(change.set.values())), waves=list(staged.waves),
                                         group=None, devices=devices, gates=gates, health_window_s=None,
                                         force_downgrade=True, allow_contract_change=False,
                                         reason=change.reason or f"target {scope} {name}".strip())
        now = time.time()
        queries.create_rollout(self.database, request, actor=actor, remote=remote, silence_s=self.context.silence_s,
                               now=now, also=lambda connection, rollout_id: desired.record_staged(
                                   connection, rollout_id, scope, name, change, actor=actor, remote=remote, now=now))

    async def device_target(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        device = _path_id(request, "device_id")
        return JSONResponse(await run_in_threadpool(
            lambda: desired.device_target(self.database, device, self.context.view())))
