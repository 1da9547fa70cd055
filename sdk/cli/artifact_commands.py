"""``edgepack build``, ``verify``, ``inspect`` and ``schema``."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import click

from edgepack_core.artifact import verify_artifact
from edgepack_core.errors import EdgepackError, UsageError
from edgepack_core.signing import RELEASE, TrustStore
from sdk.cli import VERBOSE, main
from sdk.cli.terminal import echo, echo_text
from sdk.inspect import (
    format_model_summary,
    format_nodes,
    format_view,
    inspect_artifact,
    is_tar_archive,
    load_model_for_display,
    model_summary,
    node_table,
    read_unverified_for_display,
)

CLEAR_LINE = "\r\033[K"  # carriage return, erase to the end of the line: a bar redrawn in place
_TRUST = click.option("--trust", "trust", multiple=True, type=click.Path(path_type=Path),
                      help="Trusted public key (repeat for rotation) or a folder of *.pub files.")


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--key", "keys", multiple=True, type=click.Path(path_type=Path),
              help="Private key to sign with (repeat to sign with several, e.g. during a rotation).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Artifact path to write.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the artifact path.")
@click.option("--json", "as_json", is_flag=True, help="Print the build result as JSON.")
@click.option("--progress/--no-progress", default=None,
              help="Show each step on stderr (default: only when stderr is a terminal).")
@VERBOSE
@click.option("--allow-external-paths", is_flag=True,
              help="Let the recipe name files outside its own folder (refused by default).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file that is not an Edgepack artifact.")
def build(recipe: Path, keys: tuple[Path, ...], output: Path | None, quiet: bool, as_json: bool,
          progress: bool | None, allow_external_paths: bool, force: bool) -> None:
    """Build a signed .edgepkg from RECIPE."""
    from sdk.packager.pipeline import build as run_build  # onnx import only when building
    from sdk.packager.pipeline import resolve_output
    from sdk.recipe import load_recipe  # the recipe's sections are the passes' options: imports the passes

    parsed = load_recipe(recipe, allow_external_paths=allow_external_paths)
    check_output_target(resolve_output(parsed, output), force=force)
    for key in [*keys, *([Path(parsed.sign.key)] if not keys and parsed.sign.key else [])]:
        loose = key_readable_by_others(Path(key))
        if loose:
            click.echo(f"warning: {loose}", err=True)
    show = sys.stderr.isatty() if progress is None else progress
    show = show and not quiet and not as_json

    # A log (stderr not a terminal) still gets one line per quantization candidate: a search
    # of minutes must not look like a hang in CI.
    log_lines = progress is None and not quiet and not as_json

    bar_open = False

    def report_progress(message: str) -> None:
        # On a terminal, the quantization search's "trying candidate N/M [###---]" lines redraw
        # one bar per candidate in place; the next line replaces it.
        nonlocal bar_open
        if show and message.startswith("quantize: trying "):
            click.echo(f"{CLEAR_LINE}  {message}", err=True, nl=False)
            bar_open = True
        elif show or (log_lines and message.startswith("quantize: candidate ")):
            click.echo(f"{CLEAR_LINE if bar_open else ''}  {message}", err=True)
            bar_open = False

    result = run_build(parsed, key_paths=[str(k) for k in keys], output=output, progress=report_progress)
    size = result.output.stat().st_size
    if as_json:
        click.echo(json.dumps({"artifact": str(result.output), "bytes": size, "manifest": result.manifest.to_json(),
                               "report": result.report, "warnings": result.warnings}, default=str))
    elif quiet:
        click.echo(str(result.output))
    else:
        m = result.manifest
        click.echo(f"built {result.output} ({size:,d} bytes): {m.name} {m.version}, "
                   f"{len(m.inputs)} input(s), {len(m.golden.get('samples', []))} golden sample(s), "
                   f"targets {', '.join(m.targets)}")
        for warning in result.warnings:
            click.echo(f"warning: {warning}", err=True)


def is_artifact(path: Path) -> bool:
    """True when ``path`` reads as an .edgepkg: a (gzip-compressed) tar whose first member is
    manifest.json. Reads one header, whatever the file's size."""
    import gzip
    import tarfile

    try:
        with open(path, "rb") as raw:
            magic = raw.read(2)
            raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw
            header = stream.read(tarfile.BLOCKSIZE)
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
    except (OSError, EOFError, tarfile.TarError, gzip.BadGzipFile):
        return False
    return info.name == "manifest.json"


def check_output_target(target: Path, *, force: bool) -> None:
    """Refuse to replace an existing file that is not an artifact (a recipe's ``output`` or a
    mistyped ``--output`` must not destroy an unrelated file) unless ``force``."""
    if force or not os.path.lexists(target):
        return
    if target.is_dir():
        raise UsageError(f"{target}: the output is a folder; name the artifact file")
    if not is_artifact(target):
        raise UsageError(f"{target} exists and is not an Edgepack artifact; refusing to overwrite it "
                         "(pass --force to replace it)")


def key_readable_by_others(path: Path) -> str | None:
    """A warning when a private key file can be read by group or others, else None."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None  # the signing step reports a missing key
    if mode & 0o044:
        return f"private key {path} is readable by group or others (mode {mode:04o}); chmod 600 {path}"
    return None


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@_TRUST
def verify(artifact: Path, trust: tuple[Path, ...]) -> None:
    """Verify ARTIFACT's signature and every file's hash; exit 1 if refused."""
    if not trust:
        raise click.UsageError("give at least one --trust PUBLIC key")
    result = verify_artifact(artifact, TrustStore.from_paths(trust, kind=RELEASE))
    echo(f"OK {artifact}: {result.manifest.name} {result.manifest.version}, "
         f"{len(result.manifest.files)} files verified, signed by key {result.key_id}")


@main.command()
@click.argument("artifact", metavar="ARTIFACT|MODEL", type=click.Path(path_type=Path))
@_TRUST
@click.option("--json", "as_json", is_flag=True, help="Print everything as one JSON object.")
@click.option("--nodes", is_flag=True, help="List every node: name, op type, input and output shapes (from shape "
                                            "inference); works on any .onnx model or an artifact's model.")
@click.option("--netron", is_flag=True, help="Open the packaged model in Netron (needs `pip install netron`).")
def inspect(artifact: Path, trust: tuple[Path, ...], as_json: bool, nodes: bool, netron: bool) -> None:
    """Show ARTIFACT's manifest, inputs/outputs, preprocessing, signer and build report, or a
    MODEL's inputs, outputs and ops; --nodes lists the graph's nodes with their shapes."""
    store = TrustStore.from_paths(trust, kind=RELEASE) if trust else None
    model_file = artifact.exists() and not is_tar_archive(artifact)
    if nodes or model_file:
        _inspect_model(artifact, store, as_json, nodes)
        if netron and model_file:
            _open_in_netron_file(artifact)
    else:
        view = inspect_artifact(artifact, store)
        if as_json:
            click.echo(json.dumps(view.to_json(), indent=2, sort_keys=True))
        else:  # an artifact from anywhere, read before (or without) verifying it
            echo_text(format_view(view))
    if netron and not model_file:
        _open_in_netron(artifact, read_unverified_for_display(artifact).manifest.get("model", {})
                        .get("path", "model/model.onnx"))


def _inspect_model(path: Path, trust: TrustStore | None, as_json: bool, nodes: bool) -> None:
    model = load_model_for_display(path, trust)
    if nodes:
        rows, note = node_table(model)
        if as_json:
            click.echo(json.dumps({"nodes": rows, "note": note}, indent=2))
        else:
            echo_text(format_nodes(rows, note))
        return
    summary = model_summary(model, path)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        echo_text(format_model_summary(summary))


def _open_in_netron_file(model: Path) -> None:
    try:
        import netron
    except ImportError as err:
        raise EdgepackError("Netron is not installed: pip install netron (then run inspect --netron again)") \
            from err
    netron.start(str(model))
    netron.wait()


def _open_in_netron(artifact: Path, member: str) -> None:
    try:
        import netron
    except ImportError as err:
        raise EdgepackError("Netron is not installed: pip install netron (then run inspect --netron again)") \
            from err
    import tarfile
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="edgepack-netron-"))
    with tarfile.open(artifact, "r:*") as tar:
        stream = tar.extractfile(member)
        if stream is None:
            raise EdgepackError(f"{artifact}: no {member} inside")
        (folder / "model.onnx").write_bytes(stream.read())
    click.echo(f"opening {member} in Netron (Ctrl-C to stop)", err=True)
    netron.start(str(folder / "model.onnx"))
    netron.wait()


@main.command()
@click.argument("kind", type=click.Choice(["recipe", "alerts"]), default="recipe")
def schema(kind: str) -> None:
    """Print the JSON Schema of a recipe, or of fleet serve's --alerts file (for editors and CI checks)."""
    if kind == "alerts":
        from sdk.fleet_server.alert_config import ALERTS_SCHEMA

        click.echo(json.dumps(ALERTS_SCHEMA, indent=2))
        return
    from sdk.recipe import RECIPE_SCHEMA

    click.echo(json.dumps(RECIPE_SCHEMA, indent=2))
