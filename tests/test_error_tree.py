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


def test_edgepack_v_shows_the_cause_chain_of_a_failing_command(tmp_path):
    """``-v`` prints what caused the one-line error (here the PEM loader's own complaint about a
    trust key that is not a key); without ``-v`` the error stays one line."""
    from tests.conftest import run_cli

    junk = tmp_path / "junk.pub"
    junk.write_text("not a key\n")
    artifact = tmp_path / "a.edgepkg"
    artifact.write_bytes(b"\0" * 1024)
    quiet = run_cli("edgepack", "verify", str(artifact), "--trust", str(junk))
    loud = run_cli("edgepack", "-v", "verify", str(artifact), "--trust", str(junk))
    assert quiet.returncode == loud.returncode == 1
    assert quiet.stderr.splitlines() == [f"edgepack: error: {junk}: not a PEM public key"]
    first, *causes = loud.stderr.splitlines()
    assert first == quiet.stderr.splitlines()[0] and "Traceback" not in loud.stderr
    assert len(causes) == 1 and causes[0].startswith("edgepack:   caused by ValueError: ")


def test_every_raise_from_none_says_why_the_cause_is_dropped():
    """``raise ... from err`` is the rule (``-v`` shows the chain); ``from None`` only where the
    cause is noise (a missing file the message names, a disconnect), and the line says so."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    silent = []
    for package in ("edgepack_core", "device_agent", "sdk"):
        for path in sorted((root / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            for handler in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(handler, ast.ExceptHandler):
                    continue
                for node in ast.walk(handler):
                    if isinstance(node, ast.Raise) and ast.unparse(node.cause or ast.Constant(0)) == "None":
                        said = lines[handler.lineno - 1:node.end_lineno]  # from the except line to the raise
                        if not any("  # " in line for line in said):
                            silent.append(f"{path.relative_to(root)}:{node.end_lineno}")
    assert silent == []


def test_edgepack_agent_v_shows_the_cause_chain_even_from_the_forked_verification(tmp_path):
    """``edgepack-agent predict`` verifies in a forked child; its error comes back with its
    cause, so ``-v`` prints it as ``edgepack -v`` does."""
    from tests.conftest import run_cli

    junk = tmp_path / "junk.pub"
    junk.write_text("not a key\n")
    artifact, data = tmp_path / "a.edgepkg", tmp_path / "in.json"
    artifact.write_bytes(b"\0" * 1024)
    data.write_text("{}")
    args = ("predict", "--artifact", str(artifact), "--trust", str(junk), "--input", str(data))
    quiet = run_cli("edgepack-agent", *args)
    loud = run_cli("edgepack-agent", "-v", *args)
    assert quiet.returncode == loud.returncode == 1
    assert quiet.stderr.splitlines() == [f"edgepack-agent: error: {junk}: not a PEM public key"]
    first, *causes = loud.stderr.splitlines()
    assert first == quiet.stderr.splitlines()[0] and "Traceback" not in loud.stderr
    assert len(causes) == 1 and causes[0].startswith("edgepack-agent:   caused by ValueError: ")
