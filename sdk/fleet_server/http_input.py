"""The API's input, read at the boundary: a JSON body bounded before it is read and parsed, query
parameters typed and bounded (unknown ones refused), path ids checked; every mistake an
:class:`~sdk.errors.ApiError` naming what to fix (400, 404 or 413). Used by :mod:`.api` and the
route modules beside it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import ClientDisconnect, Request

from edgepack_core.errors import SchemaError
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.schema import Validator
from sdk.errors import ApiError

MAX_JSON_BYTES = 64 * 1024


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


async def read_json(request: Request, limit: int = MAX_JSON_BYTES, *, optional: bool = False) -> dict[str, Any]:
    """The request's body as one JSON object, bounded before it is read and parsed."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ApiError(413, "too_large", f"the body is over the limit of {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, "too_large", f"the body is over the limit of {limit} bytes")
    except ClientDisconnect:  # from None: a disconnect has nothing more to say
        raise ApiError(400, "invalid", "the client went away before the body was complete") from None
    if not body and optional:
        return {}
    try:
        document = json.loads(bytes(body), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ApiError(400, "invalid", f"the body is not JSON: {str(err)[:200]}") from err
    if not isinstance(document, dict):
        raise ApiError(400, "invalid", "the body must be a JSON object")
    return document


def _validate(validator: Validator, document: dict[str, Any]) -> None:
    try:
        validator.validate(document)
    except SchemaError as err:
        raise ApiError(400, "invalid", str(err)) from err


class Params:
    """Typed, bounded query parameters; unknown ones are refused (a typo must not be ignored)."""

    def __init__(self, request: Request, allowed: set[str]) -> None:
        self.values = request.query_params
        unknown = sorted(set(self.values.keys()) - allowed)
        if unknown:
            raise ApiError(400, "invalid", f"unknown query parameter {unknown[0]!r} (allowed: "
                                           f"{', '.join(sorted(allowed)) or 'none'})")
        for key in self.values:
            if len(self.values.getlist(key)) > 1:
                raise ApiError(400, "invalid", f"query parameter {key!r} given twice")

    def text(self, name: str, *, id_like: bool = False, limit: int = 128) -> str | None:
        value = self.values.get(name)
        if value is None:
            return None
        if len(value) > limit or (id_like and not is_valid_id(value)):
            raise ApiError(400, "invalid", f"{name}: {value[:64]!r} is not a valid value")
        return value

    def integer(self, name: str, default: int, low: int, high: int) -> int:
        value = self.values.get(name)
        if value is None:
            return default
        if not value.lstrip("-").isdigit() or len(value) > 18 or not low <= int(value) <= high:
            raise ApiError(400, "invalid", f"{name}: must be a whole number in {low}..{high}")
        return int(value)

    def number(self, name: str, default: float) -> float:
        value = self.values.get(name)
        if value is None:
            return default
        try:
            number = float(value) if len(value) <= 32 else math.nan
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise ApiError(400, "invalid", f"{name}: must be a non-negative number (unix seconds)")
        return number

    def boolean(self, name: str) -> bool | None:
        value = self.values.get(name)
        if value is None:
            return None
        if value not in ("true", "false"):
            raise ApiError(400, "invalid", f"{name}: must be true or false")
        return value == "true"


def _path_id(request: Request, name: str) -> str:
    value = request.path_params[name]
    if not is_valid_id(value):
        raise ApiError(404, "not_found", f"no such {name.removesuffix('_id')}")
    return value


def _remote(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else ""
