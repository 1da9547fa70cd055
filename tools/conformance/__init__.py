"""onnx's backend test suite run over bare onnxruntime and over Edgepack's real path."""
