"""onnxruntime on the host: one place that creates CPU sessions for building and measuring."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from sdk.errors import BuildError


def cpu_session(model: bytes | str, *, threads: int = 0) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises its own untyped exceptions
        raise BuildError("onnxruntime", f"cannot create a session: {str(err).splitlines()[0]}") from None


def run_feeds(model: bytes | str | ort.InferenceSession, feeds: Sequence[dict[str, np.ndarray]]
              ) -> list[dict[str, np.ndarray]]:
    """Run each feed through the model; return output dicts by name, in feed order."""
    session = model if isinstance(model, ort.InferenceSession) else cpu_session(model)
    names = [o.name for o in session.get_outputs()]
    results = []
    for feed in feeds:
        try:
            values = session.run(names, feed)
        except Exception as err:
            raise BuildError("onnxruntime", f"inference failed: {str(err).splitlines()[0]}") from None
        results.append(dict(zip(names, values, strict=True)))
    return results
