"""``edgepack bench``."""

from __future__ import annotations

import json
from pathlib import Path

import click

from edgepack_core.signing import RELEASE, TrustStore
from sdk.bench import bench as run_bench
from sdk.cli import VERBOSE, main


@main.command()
@click.argument("model_or_artifact", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--original", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The source .onnx, measured side by side with the packaged model.")
@click.option("--trust", multiple=True, type=click.Path(path_type=Path), help="Verify the artifact first.")
@click.option("--runs", default=100, show_default=True, help="Timed runs per model.")
@click.option("--threads", default=0, help="intra-op threads (0: onnxruntime default).")
@click.option("--shape", "shapes", multiple=True, metavar="NAME=DIMS",
              help="Input shape, e.g. x=1x3x224x224 (repeat per input; NAME= may be left out for a one-input model).")
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Take input shapes, dtypes, ranges and constants from this recipe's inputs: section.")
@click.option("--json", "as_json", is_flag=True)
@VERBOSE
def bench(model_or_artifact: Path, original: Path | None, trust: tuple[Path, ...], runs: int, threads: int,
          shapes: tuple[str, ...], recipe: Path | None, as_json: bool) -> None:
    """Latency (p50/p95) and throughput on this machine, original and packaged side by side.

    Input shapes come from --shape, else the recipe's inputs: section (--recipe), else the
    artifact's golden samples, else the model's own fixed dims."""
    recipe_inputs = {}
    if recipe is not None:
        from sdk.recipe import load_recipe

        # Only the inputs: section is read; nothing the recipe names is opened, wherever it is.
        recipe_inputs = dict(load_recipe(recipe, allow_external_paths=True).data.get("inputs") or {})
    if runs < 1:
        raise click.BadParameter("must be at least 1", param_hint="--runs")
    store = TrustStore.from_paths(trust, kind=RELEASE) if trust else None
    results = run_bench(model_or_artifact, original=original, trust=store,
                        runs=runs, threads=threads, shapes=list(shapes), recipe_inputs=recipe_inputs)
    if as_json:
        click.echo(json.dumps([r.to_json() for r in results]))
        return
    click.echo(f"{'MODEL':<40} {'P50 MS':>9} {'P95 MS':>9} {'PER S':>9} {'BYTES':>12}")
    for r in results:
        click.echo(f"{r.label[:40]:<40} {r.p50_ms:>9.3f} {r.p95_ms:>9.3f} {r.throughput_per_s:>9.1f} {r.bytes:>12,d}")
    for measured in {json.dumps(r.shapes, sort_keys=True): r.shapes for r in results}.values():
        click.echo("inputs: " + ", ".join(f"{name}={'x'.join(str(d) for d in dims) or 'scalar'}"
                                          for name, dims in measured.items()))
    if len(results) == 2:
        click.echo(f"packaged/original latency ratio: {results[1].p50_ms / results[0].p50_ms:.2f}x, "
                   f"size ratio: {results[0].bytes / results[1].bytes:.2f}x smaller")
