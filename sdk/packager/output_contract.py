"""What the model really returns, against what its graph declares (issue 23, item 1).

The device's smoke test refuses an output whose shape is not the declared one, so a graph whose
annotations are stale (an exporter that wrote ``[1, seqlen]`` for a ``[seqlen, 1, C]`` tensor)
would build, sign, and then be refused by every device. The golden pass runs the final model,
and these pure functions decide from its outputs what the contract really is: declared dims
kept where every sample fits them, otherwise the observed dims, symbolic where they vary across
samples (named after the input dim that moves with them when there is one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgepack_core.manifest import TensorSpec
from sdk.errors import ContractError

Dim = int | str


@dataclass(frozen=True)
class Repair:
    """One output whose declared shape was replaced by the real one."""

    output: str
    declared: tuple[Dim, ...]
    real: tuple[Dim, ...]

    def to_json(self) -> dict[str, object]:
        return {"output": self.output, "declared": list(self.declared), "real": list(self.real)}


def fits(shape: Sequence[int], declared: Sequence[Dim]) -> bool:
    """The smoke test's rule: same rank, every fixed dim equal. Pure."""
    return len(shape) == len(declared) and all(isinstance(d, str) or d == shape[i] for i, d in enumerate(declared))


def input_symbols(inputs: Sequence[TensorSpec], feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, list[int]]:
    """Each named input dim and the value it took in each sample, in sample order."""
    symbols: dict[str, list[int]] = {}
    for spec in inputs:
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str) and all(spec.name in feed and feed[spec.name].ndim > axis for feed in feeds):
                symbols.setdefault(dim, [int(feed[spec.name].shape[axis]) for feed in feeds])
    return symbols


def _axis_dim(
    name: str, axis: int, values: list[int], preferred: list[str], symbols: Mapping[str, list[int]], used: set[str]
) -> Dim:
    """One axis of the real shape: an input symbol that takes exactly these values (a constant
    only through a symbol the output already declared), else the constant, else a new name."""
    varies = len(set(values)) > 1
    pool = [s for s in preferred if s not in used] + ([s for s in symbols if s not in used] if varies else [])
    for symbol in pool:
        if symbols.get(symbol) == values:
            used.add(symbol)
            return symbol
    return f"{name}_dim{axis}" if varies else values[0]


def real_output_shape(
    name: str, declared: Sequence[Dim], seen: Sequence[Sequence[int]], symbols: Mapping[str, list[int]]
) -> list[Dim]:
    """The shape to declare for output ``name`` seen as ``seen`` (one shape per sample, same
    rank): ``declared`` when every sample fits it. Pure."""
    if all(fits(shape, declared) for shape in seen):
        return list(declared)
    preferred = [d for d in declared if isinstance(d, str)]
    used: set[str] = set()
    return [
        _axis_dim(name, axis, [int(shape[axis]) for shape in seen], preferred, symbols, used)
        for axis in range(len(seen[0]))
    ]


def _check_output(spec: TensorSpec, values: Sequence[np.ndarray]) -> None:
    ranks = sorted({value.ndim for value in values})
    if len(ranks) > 1:
        raise ContractError(
            f"output {spec.name} returns rank {' and '.join(map(str, ranks))} on different "
            "samples; a device cannot be given one shape for it"
        )
    dtypes = sorted({tensor_dtype_name_of(value) for value in values})
    if dtypes != [spec.dtype]:
        raise ContractError(
            f"output {spec.name} is declared {spec.dtype} but the model returns "
            f"{', '.join(dtypes)}; fix the export's output type"
        )


def tensor_dtype_name_of(value: np.ndarray) -> str:
    """The manifest's dtype name of an onnxruntime result (strings come back as objects)."""
    return "string" if value.dtype.kind in "OUS" else value.dtype.name


def real_contract(
    outputs: Sequence[TensorSpec],
    inputs: Sequence[TensorSpec],
    feeds: Sequence[Mapping[str, np.ndarray]],
    results: Sequence[Mapping[str, np.ndarray]],
) -> tuple[list[TensorSpec], list[Repair]]:
    """The outputs as the model really returns them on ``feeds``, and what changed. Raises
    :class:`ContractError` naming an output that cannot be described. Pure."""
    symbols = input_symbols(inputs, feeds)
    specs: list[TensorSpec] = []
    repairs: list[Repair] = []
    for spec in outputs:
        values = [result[spec.name] for result in results if spec.name in result]
        if not values:
            specs.append(spec)
            continue
        _check_output(spec, values)
        shape = tuple(real_output_shape(spec.name, spec.shape, [v.shape for v in values], symbols))
        if shape != tuple(spec.shape):
            repairs.append(Repair(spec.name, tuple(spec.shape), shape))
        specs.append(TensorSpec(spec.name, spec.dtype, shape))
    return specs, repairs
