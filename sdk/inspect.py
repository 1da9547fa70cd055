"""Reading an artifact for display. Without a trust store nothing is verified, and the name
of the reader says so: ``read_unverified_for_display`` never feeds a device or a build."""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgepack_core.artifact import Limits, verify_artifact
from edgepack_core.errors import ArtifactError, ManifestError, TruncatedArchiveError
from edgepack_core.manifest import MANIFEST_NAME, REPORT_NAME, SIGNATURE_NAME
from edgepack_core.signing import TrustStore


@dataclass
class ArtifactView:
    path: Path
    manifest: dict[str, Any]
    signature_key_ids: list[str]
    report: dict[str, Any] | None
    verified_by: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "artifact": str(self.path),
            "verified": self.verified_by is not None,
            "verified_by": self.verified_by,
            "signature_key_ids": self.signature_key_ids,
            "manifest": self.manifest,
            "report": self.report,
        }


def read_unverified_for_display(path: Path, limits: Limits | None = None) -> ArtifactView:
    """Manifest, signature key ids and report of an artifact, NOT verified (display only)."""
    limits = limits or Limits()
    wanted = {MANIFEST_NAME: limits.max_manifest_bytes, SIGNATURE_NAME: 64 * 1024, REPORT_NAME: 16 * 1024**2}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if member.name in wanted and member.isfile() and member.size <= wanted[member.name]:
                    stream = tar.extractfile(member)
                    assert stream is not None
                    found[member.name] = stream.read()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such artifact") from None
    except (tarfile.TarError, EOFError, OSError) as err:
        raise TruncatedArchiveError(f"{path}: not a complete tar archive ({err})") from None
    if MANIFEST_NAME not in found:
        raise ManifestError(f"{path}: no {MANIFEST_NAME}")
    try:
        manifest = json.loads(found[MANIFEST_NAME])
        signature = json.loads(found.get(SIGNATURE_NAME, b"{}"))
        report = json.loads(found[REPORT_NAME]) if REPORT_NAME in found else None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{path}: unreadable JSON ({err})") from None
    key_ids = [s.get("key_id", "?") for s in signature.get("signatures", []) if isinstance(s, dict)]
    return ArtifactView(path, manifest, key_ids, report, None)


def inspect_artifact(path: Path, trust: TrustStore | None) -> ArtifactView:
    """With a trust store, verify fully first and show what was verified."""
    verified_by = verify_artifact(path, trust).key_id if trust is not None else None
    view = read_unverified_for_display(path)
    view.verified_by = verified_by
    return view


def _shape(shape: list[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_view(view: ArtifactView) -> str:
    """The human summary printed by ``edgepack inspect``."""
    m = view.manifest
    lines = [
        f"{m.get('name')} {m.get('version')}  ({view.path})",
        f"  created      {m.get('created')}",
        f"  signed by    {', '.join(view.signature_key_ids) or 'UNSIGNED'}"
        + (f"  (verified with key {view.verified_by})" if view.verified_by else "  (not verified: pass --trust)"),
        f"  model        {m.get('model', {}).get('path')}  opset {m.get('model', {}).get('opset')}  "
        f"precision {m.get('model', {}).get('precision', 'fp32')}  "
        f"onnxruntime >= {m.get('model', {}).get('min_onnxruntime')}",
        "  inputs",
        *[f"    {t['name']:<20} {t['dtype']:<8} {_shape(t['shape'])}" for t in m.get("inputs", [])],
        "  outputs",
        *[f"    {t['name']:<20} {t['dtype']:<8} {_shape(t['shape'])}" for t in m.get("outputs", [])],
        f"  preprocess   {json.dumps(m.get('preprocess'), sort_keys=True)}",
        f"  postprocess  {json.dumps(m.get('postprocess'), sort_keys=True)}",
        "  targets      " + ", ".join(f"{t} ({' > '.join(v.get('providers', []))})"
                                      for t, v in m.get("targets", {}).items()),
        f"  golden       {len(m.get('golden', {}).get('samples', []))} sample(s)",
        "  files",
        *[f"    {name:<32} {entry['size']:>12,d}  sha256 {entry['sha256'][:16]}…"
          for name, entry in sorted(m.get("files", {}).items())],
    ]
    report = view.report or {}
    if report:
        lines.append("  build report")
        for name, data in report.get("passes", {}).items():
            lines.append(f"    {name:<16} {json.dumps(data, sort_keys=True, default=str)[:160]}")
        for warning in report.get("warnings", []):
            lines.append(f"    warning: {warning}")
    return "\n".join(lines)
