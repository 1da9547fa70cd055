"""The HTTP routes of device enrollment (:mod:`.enrollment`), wired into :func:`.api.build_app`.

- ``POST /api/devices/{id}/enrollment`` (admins; audited ``device.enroll_identity``): a one-time
  token for the device, with its groups, ``password`` for a broker password instead of a
  certificate, and its lifetime.
- ``POST /api/enroll`` (devices; authenticated by the one-time token alone, body bounded to
  :data:`MAX_ENROLL_BODY` and the CSR to :data:`~.ca.MAX_CSR_BYTES` before anything is parsed):
  the certificate, the CA bundle, the broker address and the groups.
- ``POST /api/devices/{id}/revoke`` (admins; audited ``device.revoke``): its certificates into the
  CRL, its broker password removed. ``DELETE /api/devices/{id}`` (decommission) revokes too.
- ``GET /api/devices/{id}/credentials`` (a read, viewers): its newest certificates' serials,
  validity and ``renewal_from`` (when rotation starts) and whether it holds a broker password
  (``edgepack device show``: the expiry; the dashboard's device page).

A server started without a CA folder (``fleet serve --ca-dir``) answers 503 naming the flag.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgepack_core.schema import Validator
from sdk.errors import ApiError
from sdk.fleet_server import api
from sdk.fleet_server.ca import MAX_CSR_BYTES
from sdk.fleet_server.enrollment import DEFAULT_TOKEN_TTL_S, Enrollment, renewal_from
from sdk.fleet_server.enrollment_openapi import ENROLL_REQUEST_SCHEMA, REVOKE_REQUEST_SCHEMA, TOKEN_REQUEST_SCHEMA
from sdk.fleet_server.enrollment_tables import device_credentials

MAX_ENROLL_BODY = 16 * 1024
_TOKEN_VALIDATOR = Validator(TOKEN_REQUEST_SCHEMA, document="enrollment")
_ENROLL_VALIDATOR = Validator(ENROLL_REQUEST_SCHEMA, document="enroll")
_REVOKE_VALIDATOR = Validator(REVOKE_REQUEST_SCHEMA, document="revoke")

Handler = Callable[[Request, str], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def _enrollment(context: api.ApiContext) -> Enrollment:
    if context.enrollment is None:
        raise ApiError(503, "unavailable", "this server does not enroll devices (start fleet serve with --ca-dir)")
    return context.enrollment


class EnrollmentRoutes:
    """The handlers; those taking ``(request, actor)`` run behind the API's guard."""

    def __init__(self, context: api.ApiContext) -> None:
        self.context = context

    async def create_token(self, request: Request, actor: str) -> Response:
        api.Params(request, set())
        device = api._path_id(request, "device_id")
        body = await api.read_json(request, optional=True)
        api._validate(_TOKEN_VALIDATOR, body)
        enrollment = _enrollment(self.context)
        groups = list(dict.fromkeys(body.get("groups", [])))
        done = await run_in_threadpool(
            lambda: enrollment.create_token(
                device,
                groups,
                password=bool(body.get("password")),
                ttl_s=float(body.get("expires_in_s", DEFAULT_TOKEN_TTL_S)),
                actor=actor,
                remote=api._remote(request),
            )
        )
        return JSONResponse(done, status_code=201)

    async def redeem(self, request: Request) -> Response:
        api.Params(request, set())
        body = await api.read_json(request, MAX_ENROLL_BODY)
        csr = body.get("csr")
        if isinstance(csr, str) and len(csr.encode("utf-8", "surrogatepass")) > MAX_CSR_BYTES:
            raise ApiError(413, "too_large", f"csr: over the limit of {MAX_CSR_BYTES} bytes")
        api._validate(_ENROLL_VALIDATOR, body)
        enrollment = _enrollment(self.context)
        answer = await run_in_threadpool(lambda: enrollment.redeem(body["token"], csr, remote=api._remote(request)))
        return JSONResponse(answer, headers={"Cache-Control": "no-store"})

    async def revoke(self, request: Request, actor: str) -> Response:
        api.Params(request, set())
        device = api._path_id(request, "device_id")
        body = await api.read_json(request, optional=True)
        api._validate(_REVOKE_VALIDATOR, body)
        enrollment = _enrollment(self.context)
        return JSONResponse(
            await run_in_threadpool(
                lambda: enrollment.revoke(
                    device, reason=body.get("reason", ""), actor=actor, remote=api._remote(request)
                )
            )
        )

    async def credentials(self, request: Request, _actor: str) -> Response:
        api.Params(request, set())
        device = api._path_id(request, "device_id")
        doc = await run_in_threadpool(device_credentials, self.context.database, device)
        for certificate in doc["certificates"]:  # when the server starts rotating it: the dashboard's warning
            certificate["renewal_from"] = renewal_from(certificate["not_before"], certificate["not_after"])
        return JSONResponse(doc)

    def decommission(self, handler: Handler) -> Handler:
        """The decommission handler, then the device's credentials revoked (when this server
        enrolls devices): a decommissioned device cannot connect with them again."""

        async def decommission_and_revoke(request: Request, actor: str) -> Response:
            response = await handler(request, actor)
            enrollment = self.context.enrollment
            if enrollment is not None:
                device = api._path_id(request, "device_id")
                await run_in_threadpool(
                    lambda: enrollment.revoke(
                        device, reason="decommissioned", actor=actor, remote=api._remote(request), must_exist=False
                    )
                )
            return response

        return decommission_and_revoke


def routes(context: api.ApiContext, guard: Callable[..., Endpoint]) -> list[Route]:
    """The enrollment routes, for :func:`.api.build_app`."""
    r = EnrollmentRoutes(context)
    return [
        Route("/api/enroll", r.redeem, methods=["POST"]),
        Route("/api/devices/{device_id}/enrollment", guard(r.create_token, "device.enroll_identity"), methods=["POST"]),
        Route("/api/devices/{device_id}/revoke", guard(r.revoke, "device.revoke"), methods=["POST"]),
        Route("/api/devices/{device_id}/credentials", guard(r.credentials), methods=["GET"]),
    ]


def decommission_route(context: api.ApiContext, guard: Callable[..., Endpoint], handler: Handler) -> Route:
    """``DELETE /api/devices/{id}``: the decommission that also revokes."""
    return Route(
        "/api/devices/{device_id}",
        guard(EnrollmentRoutes(context).decommission(handler), "device.decommission"),
        methods=["DELETE"],
    )
