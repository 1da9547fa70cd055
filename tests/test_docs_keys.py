"""The docs cannot rot: every recipe key of the JSON Schema (generated from the passes' option
declarations) is named in docs/packager.md's key table with its default, the table names no
other, the shipped schemas/recipe.schema.json is the generated one, every
task kind and data source has an example there, and the Python API examples of docs/agent.md
run as written against real artifacts."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sdk.recipe import RECIPE_SCHEMA
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parent.parent
PACKAGER_DOCS = REPO / "docs" / "packager.md"
AGENT_DOCS = REPO / "docs" / "agent.md"


def schema_key_paths(schema: dict[str, Any]) -> list[str]:
    """Every key path a document of ``schema`` may hold, dotted, in schema order: object
    properties, the branches of oneOf/anyOf/allOf at the same path, and ``NAME`` for the keys
    of a map (``additionalProperties`` with properties of its own: ``inputs.NAME.role``)."""
    paths: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        for key, sub in (node.get("properties") or {}).items():
            if f"{prefix}{key}" not in paths:
                paths.append(f"{prefix}{key}")
            walk(sub, f"{prefix}{key}.")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{prefix}NAME.")
        for combinator in ("oneOf", "anyOf", "allOf"):
            for branch in node.get(combinator, []):
                walk(branch, prefix)

    walk(schema, "")
    return paths


def undocumented(schema: dict[str, Any], docs: str) -> list[str]:
    """The key paths of ``schema`` that ``docs`` never names in backticks."""
    named = set(re.findall(r"`([^`\n]+)`", docs))
    return [path for path in schema_key_paths(schema) if path not in named]


def test_the_walker_reaches_map_keys_and_every_branch():
    schema = {"properties": {
        "a": {"properties": {"b": {}, "c": {"oneOf": [{"properties": {"d": {}}}, {"properties": {"e": {}}}]}}},
        "m": {"additionalProperties": {"properties": {"role": {}}}},
        "s": {"additionalProperties": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
    }}
    assert schema_key_paths(schema) == ["a", "a.b", "a.c", "a.c.d", "a.c.e", "m", "m.NAME.role", "s"]


def test_every_recipe_key_is_explained_in_the_packager_docs():
    missing = undocumented(RECIPE_SCHEMA, PACKAGER_DOCS.read_text())
    assert not missing, f"docs/packager.md does not mention these recipe keys: {', '.join(missing)}"
    assert len(schema_key_paths(RECIPE_SCHEMA)) > 100  # the walk went everywhere


def test_every_agent_yaml_key_is_explained_in_the_agent_docs():
    from device_agent.config import CONFIG_SCHEMA

    missing = undocumented(CONFIG_SCHEMA, AGENT_DOCS.read_text())
    assert not missing, f"docs/agent.md does not mention these agent.yaml keys: {', '.join(missing)}"
    assert "mqtt.queue.max_bytes" in schema_key_paths(CONFIG_SCHEMA)  # the walk reached nested sections


def test_a_key_the_docs_leave_out_is_named():
    schema = copy.deepcopy(RECIPE_SCHEMA)
    schema["properties"]["quantize"]["properties"]["bogus_knob"] = {"type": "boolean"}
    schema["properties"]["inputs"]["additionalProperties"]["properties"]["bogus_role"] = {"type": "string"}
    docs = PACKAGER_DOCS.read_text()
    planted = [path for path in undocumented(schema, docs) if path not in undocumented(RECIPE_SCHEMA, docs)]
    assert planted == ["inputs.NAME.bogus_role", "quantize.bogus_knob"]


def key_table_rows(docs: str) -> dict[str, str]:
    """docs/packager.md's "Recipe keys" tables: each key named in a row's first column -> the row."""
    section = docs[docs.index("\n## Recipe keys\n"):docs.index("\n## ", docs.index("\n## Recipe keys\n") + 1)]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            for key in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
                rows[key] = line
    return rows


def schema_defaults(schema: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every key path of ``schema`` that declares a default -> the default."""
    found: dict[str, Any] = {}
    for key, sub in (schema.get("properties") or {}).items():
        if "default" in sub:
            found[f"{prefix}{key}"] = sub["default"]
        found.update(schema_defaults(sub, f"{prefix}{key}."))
    if isinstance(schema.get("additionalProperties"), dict):
        found.update(schema_defaults(schema["additionalProperties"], f"{prefix}NAME."))
    return found


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_the_key_table_names_exactly_the_keys_the_option_declarations_generate():
    rows = key_table_rows(PACKAGER_DOCS.read_text())
    keys = set(schema_key_paths(RECIPE_SCHEMA))
    assert sorted(keys - set(rows)) == [], "keys the table of docs/packager.md leaves out"
    assert sorted(set(rows) - keys) == [], "keys the table names that no option declares"


def test_the_key_table_states_each_declared_default():
    rows = key_table_rows(PACKAGER_DOCS.read_text())
    defaults = schema_defaults(RECIPE_SCHEMA)
    assert defaults["quantize.max_candidates"] == 10 and defaults["optimize.fold_batchnorm"] is True
    wrong = [f"{path} ({_shown(value)})" for path, value in defaults.items()
             if not re.search(rf"(?<![\w.]){re.escape(_shown(value))}(?!\w)", rows[path])]
    assert wrong == [], "docs/packager.md's key table does not state these defaults"


def test_the_shipped_schema_file_is_the_generated_schema():
    published = REPO / "schemas" / "recipe.schema.json"
    assert json.loads(published.read_text()) == json.loads(json.dumps(RECIPE_SCHEMA)), (
        "schemas/recipe.schema.json is stale: run `edgepack schema recipe > schemas/recipe.schema.json`"
    )


def test_the_walked_schema_is_the_one_edgepack_prints():
    run = run_cli("edgepack", "schema", "recipe")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == json.loads(json.dumps(RECIPE_SCHEMA))


def _examples(docs: str) -> str:
    """The indented and fenced example blocks of a Markdown text, joined."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", docs, flags=re.S)
    blocks += ["\n".join(line[4:] for line in block.splitlines())
               for block in re.findall(r"(?:^ {4}.*\n?)+", docs, flags=re.M)]
    return "\n".join(blocks)


def test_each_task_kind_and_data_source_has_an_example():
    examples = _examples(PACKAGER_DOCS.read_text())
    kinds = RECIPE_SCHEMA["properties"]["postprocess"]["properties"]["kind"]["enum"]
    for kind in kinds:
        assert re.search(rf"kind: {kind}\b", examples), f"no postprocess example of kind {kind}"
    for kind in RECIPE_SCHEMA["properties"]["preprocess"]["properties"]["kind"]["enum"]:
        assert re.search(rf"kind: {kind}\b", examples), f"no preprocess example of kind {kind}"
    sources = RECIPE_SCHEMA["properties"]["validate"]["properties"]["data"]["oneOf"]
    keys = [branch["required"][0] for branch in sources if "required" in branch]
    assert keys == ["npz", "test_data", "images", "audio"]
    for key in [*keys, "synthetic"]:
        assert re.search(rf"\{{{key}: |data: {key}\b", examples), f"no data source example with {key}"


def python_api_code(docs: str) -> str:
    """The ```python blocks of the "Python API" section, in order: one program."""
    section = docs[docs.index("\n## Python API\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) >= 2, "the Python API section lost its examples"
    return "\n".join(blocks)


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory, keypair) -> Path:
    """What the examples expect: keys/release.pub, dist/digits.edgepkg, dist/vad.edgepkg and the
    demo data they read, as tools/demo.sh leaves them."""
    from sdk.packager.pipeline import build
    from sdk.recipe import load_recipe
    from tools.demos import build_all
    from tools.demos.vad import build_vad

    root = tmp_path_factory.mktemp("docs")
    build_all(root / "demo", ["digits"])
    build_vad(root / "demo" / "vad")
    (root / "keys").mkdir()
    shutil.copy(keypair[1], root / "keys" / "release.pub")
    (root / "recipes").mkdir()
    for name in ("digits", "vad"):
        shutil.copy(REPO / "recipes" / f"{name}.yaml", root / "recipes")
        build(load_recipe(root / "recipes" / f"{name}.yaml", allow_external_paths=True), key_paths=[str(keypair[0])],
              output=root / "dist" / f"{name}.edgepkg")
    return root


def test_the_python_api_examples_of_the_agent_docs_run_as_written(demo_folder):
    code = python_api_code(AGENT_DOCS.read_text())
    run = subprocess.run([sys.executable, "-c", code], cwd=demo_folder, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert re.fullmatch(r"digit \d \(\d\.\d\d\) on CPUExecutionProvider in \d+\.\d\d ms", lines[0]), lines
    assert lines[1].startswith("raw logits (1, 10) top ")
    assert "'result'" in lines[2] and "'model'" in lines[2]
    assert re.fullmatch(r"typed \d", lines[3]), lines  # a typed request (device_agent/prediction.py)
    assert re.fullmatch(r"frames \(\d+, 1, 1\)", lines[4]) and lines[5] == "stream kept: True"
    assert lines[7] == "pushed 6 events [('seen', 'count_above', 1)]", lines  # frames pushed from Python
    assert (demo_folder / "models" / "digits" / "manifest.json").exists()  # extracted where the example said
