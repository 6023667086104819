"""The GLM-5 inference worker: engine, KV cache management, gRPC server."""
