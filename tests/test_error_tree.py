"""One error tree per side: every exception class a product module defines is an
:class:`~edgepack_core.errors.EdgepackError`, and a host or device class is under its side's base."""

from __future__ import annotations

import subprocess
import sys

_WALK = r"""
import importlib, inspect, pkgutil
import device_agent, edgepack_core, sdk
from edgepack_core.errors import EdgepackError
from device_agent.errors import AgentError
from sdk.errors import HostError
bases = {"edgepack_core": EdgepackError, "device_agent": AgentError, "sdk": HostError}
for package in (edgepack_core, device_agent, sdk):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith("__main__") or ".migrations" in info.name:  # alembic scripts, not modules
            continue
        module = importlib.import_module(info.name)
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                side = bases[info.name.split(".")[0]]
                if not issubclass(cls, side):
                    print(f"{info.name}.{name} is not under {side.__name__}")
                if not info.name.endswith(".errors") and not name.startswith("_"):
                    print(f"{info.name}.{name} is defined outside the errors modules")
"""


def test_every_exception_class_a_product_module_defines_is_in_its_sides_tree():
    """Walks every module of edgepack_core, device_agent and sdk (in a child, so the imports
    stay out of the test process): each exception class is under EdgepackError and its side's
    base (AgentError on the device, HostError on the host), and only private signals (named
    ``_...``, never seen by a caller) live outside the three errors modules."""
    walked = subprocess.run([sys.executable, "-c", _WALK], capture_output=True, text=True, check=True)
    assert walked.stdout.splitlines() == []


def test_the_two_sides_share_one_root_and_one_invalid_transition():
    from device_agent import errors as agent
    from edgepack_core import errors as core
    from sdk import errors as host

    assert issubclass(agent.AgentError, core.EdgepackError) and issubclass(host.HostError, core.EdgepackError)
    assert not issubclass(agent.AgentError, host.HostError) and not issubclass(host.HostError, agent.AgentError)
    from device_agent.updates.jobs import InvalidTransition as JobTransition
    from sdk.fleet_server.rollouts import InvalidTransition as RolloutTransition

    assert JobTransition is RolloutTransition is core.InvalidTransition
    assert not issubclass(core.InvalidTransition, host.ApiError)
