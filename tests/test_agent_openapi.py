"""The agent's OpenAPI document (device_agent/http/openapi.py): the committed copy is current, it
names exactly the routes the app has, and a running agent serves it unchanged by the request."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from device_agent.config import ApiSettings
from device_agent.http import openapi
from device_agent.http.app import AgentApp
from device_agent.http.server import ApiServer
from device_agent.runtime import InferenceService

COMMITTED = Path(__file__).resolve().parent.parent / "schemas" / "agent-openapi.json"


def test_committed_agent_openapi_document_is_current():
    assert COMMITTED.read_bytes() == openapi.document_bytes(), (
        "schemas/agent-openapi.json is stale: run `python -m device_agent.http.openapi > schemas/agent-openapi.json`")


def test_agent_openapi_describes_exactly_the_routes_the_app_has():
    app = AgentApp(InferenceService(), ApiSettings())
    try:
        served = {(method.lower(), route.path) for route in app.router.routes
                  for method in route.methods if method != "HEAD"}
    finally:
        app.pool.shutdown()
    described = {(method, path) for path, item in openapi.describe()["paths"].items() for method in item}
    assert described == served


def test_agent_serves_its_openapi_document_whatever_the_host_header():
    server = ApiServer(("127.0.0.1", 0), InferenceService()).start()
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/openapi.json",
                                         headers={"Host": "evil.example:666"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
            assert response.headers["content-type"] == "application/json"
    finally:
        server.stop()
    assert body == openapi.document_bytes() and b"evil.example" not in body
    assert json.loads(body)["openapi"] == "3.1.0"
