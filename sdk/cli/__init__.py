"""``edgepack``: thin click commands over the library. Errors become one line here, only here.

Each command lives in its own module and registers itself on :data:`main`; this module turns
every :class:`EdgepackError` into ``edgepack: <message>`` on stderr with the error's exit code
(1 for a failed operation, 2 for bad usage), so no expected failure shows a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from edgepack_core.errors import EdgepackError, cause_chain


def _set_verbose(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta["edgepack.verbose"] = True
        from sdk.packager import ort_host  # numpy only; onnxruntime loads in the worker

        ort_host.set_verbose(True)
    return value


VERBOSE = click.option("-v", "--verbose", is_flag=True, expose_value=False, is_eager=True, callback=_set_verbose,
                       help="Show onnxruntime's own log lines and an error's cause chain.")


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EdgepackError as err:  # its message may quote a device's or the server's text
            from sdk.cli.terminal import echo

            echo(f"edgepack: error: {err}", err=True)
            if ctx.meta.get("edgepack.verbose"):
                echo(*(f"edgepack:   {line}" for line in cause_chain(err)), err=True)
            sys.exit(err.exit_code)
        except KeyboardInterrupt:
            click.echo("edgepack: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgepack", prog_name="edgepack")
@VERBOSE
def main() -> None:
    """Package ONNX models into signed artifacts and run them on fleets of edge devices."""


# Register the commands (each module adds itself to ``main``).
from sdk.cli import artifact_commands, artifact_marks, bench, deploy, enroll, fleet, fleet_server  # noqa: E402,F401  isort: skip
from sdk.cli import device_logs, device_show, fleet_db, fleet_settings, keys, rollout, target, tokens  # noqa: E402,F401  isort: skip
