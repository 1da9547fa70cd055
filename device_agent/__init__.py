"""The device side of Edgepack: model store, runtime, preprocessing, telemetry, updates.

Never imports onnx, click or host-only code (``sdk``); see docs/architecture.md.
"""
