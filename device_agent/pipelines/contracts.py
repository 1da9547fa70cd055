"""The installed models' contracts as a pipeline check needs them, read from the store.

I/O around the pure :func:`~.checks.check_models`: each model's active, re-verified manifest
(its preprocessing kind, its postprocessing kind, its labels file) becomes a
:class:`~.checks.StageContract`, under its name (a slot's model carries its slot's name).
"""

from __future__ import annotations

from device_agent.config import AgentConfig
from device_agent.errors import PipelineRefused
from device_agent.pipelines.checks import StageContract
from device_agent.store import InstalledModel, ModelStore
from edgepack_core.errors import EdgepackError
from edgepack_core.postprocess import load_labels
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.signing import TrustStore

MAX_LABELS_BYTES = 4 * 1024 * 1024


def contract_of(installed: InstalledModel) -> StageContract:
    """What a pipeline may assume of ``installed``, from its verified manifest."""
    manifest = installed.verified.manifest
    post = manifest.postprocess
    labels = None
    if post.labels:
        path = installed.directory / post.labels
        if path.stat().st_size > MAX_LABELS_BYTES:
            raise PipelineRefused("pipelines", f"{manifest.name}'s labels file is over {MAX_LABELS_BYTES} bytes")
        labels = tuple(load_labels(path.read_text(encoding="utf-8")))
    return StageContract(manifest.preprocess.kind, post.kind, labels)


def installed_contracts(config: AgentConfig) -> dict[str, StageContract]:
    """The contract of every model the agent of ``config`` serves, by name: the root store's
    model and each ``slots/<name>/`` store's (a slot's model carries its slot's name)."""
    from device_agent.models import SLOTS_DIR

    trust = TrustStore.from_paths([str(path) for path in config.trust])
    slots = config.store / SLOTS_DIR
    roots = [config.store, *(sorted(p for p in slots.iterdir() if is_valid_id(p.name) and p.is_dir())
                             if slots.is_dir() else [])]
    contracts: dict[str, StageContract] = {}
    for root in roots:
        try:
            installed = ModelStore(root, trust).active() if root.is_dir() else None
        except EdgepackError as err:
            raise PipelineRefused("pipelines", f"cannot read the installed model in {root}: {err}") from err
        if installed is not None:
            contracts[installed.name] = contract_of(installed)
    return contracts
