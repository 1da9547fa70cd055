"""The container files read as the rules of issue 25 item 9 say (tools/docker_check.sh builds and
runs them in CI; these are the fast checks of what that run cannot notice drifting):

- the server image installs the server extra of pyproject.toml without the packager's host extra,
  so deploy/docker/server-requirements.txt is that list, specifier for specifier;
- both Dockerfiles take their base as the build argument BASE, run as a non-root user, keep their
  state on volumes and carry a HEALTHCHECK on /healthz made with Python's urllib (no curl);
- the compose file's images are variables with real-world defaults, every service has a
  health check and restarts unless stopped, and passwords are files (secrets), never values in
  an environment or the database URL.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "deploy" / "docker"


def _requirements(lines: list[str]) -> set[str]:
    return {re.sub(r"\s+", "", line) for line in lines if line.strip() and not line.lstrip().startswith("#")}


def test_the_server_image_installs_the_server_extra_without_the_packager() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    server = _requirements([r for r in extras["server"] if not r.startswith("edgepack[")])
    click = {r for r in _requirements(extras["host"]) if r.startswith("click")}
    assert len(click) == 1, "the host extra names click once"
    wanted = {"edgepack"} | server | click
    listed = _requirements((DOCKER / "server-requirements.txt").read_text().splitlines())
    assert listed == wanted, f"deploy/docker/server-requirements.txt: add {wanted - listed}, drop {listed - wanted}"


@pytest.mark.parametrize("image", ["agent", "server"])
def test_a_dockerfile_takes_its_base_and_runs_unprivileged_with_a_health_check(image: str) -> None:
    text = (DOCKER / f"{image}.Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0].startswith("ARG BASE="), "ARG BASE comes before the first FROM"
    froms = [line for line in lines if line.startswith("FROM ")]
    assert froms and all(line.split()[1] == "${BASE}" for line in froms), froms
    final = text[text.rindex("\nFROM ") :]
    user = re.search(r"^USER (\S+)", final, re.MULTILINE)
    assert user and user.group(1).split(":")[0] not in ("0", "root"), "the final stage runs as a non-root user"
    assert re.search(r"^VOLUME \[", final, re.MULTILINE), "state on a volume"
    health = re.search(r"^HEALTHCHECK .*?CMD (\[.*?\])$", final, re.MULTILINE | re.DOTALL)
    assert health and "urllib.request" in health.group(1) and "curl" not in final
    assert "--no-index" in text, "the build installs from the wheels in its context only"


def test_the_compose_stack_has_health_checks_and_images_as_variables() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"mosquitto", "postgres", "server", "agent"}
    assert services["mosquitto"]["image"] == "${EDGEPACK_MOSQUITTO_IMAGE:-eclipse-mosquitto:2}"
    assert services["postgres"]["image"] == "${EDGEPACK_POSTGRES_IMAGE:-postgres:16}"
    for name, service in services.items():
        assert service["image"].startswith("${EDGEPACK_"), f"{name}: the image is a variable"
        assert service["restart"] == "unless-stopped", name
        assert "healthcheck" in service, name
    for name, service in services.items():  # secrets are files: nothing in an environment or a command line
        for key in service.get("environment", {}):
            assert "PASSWORD" not in key or key.endswith("_FILE"), f"{name}: {key}"
    url = services["server"]["environment"]["EDGEPACK_FLEET_DB"]
    assert re.fullmatch(r"postgresql://[^:@/]+@[^@]+", url), f"no password in the database URL: {url}"
    assert "--db-password-file=/run/secrets/db.pw" in services["server"]["command"]
    for name in ("server", "agent"):  # their images' HEALTHCHECK, only its timing set here
        assert "test" not in services[name]["healthcheck"], name
    assert services["server"]["depends_on"] == {
        "mosquitto": {"condition": "service_healthy"},
        "postgres": {"condition": "service_healthy"},
    }
