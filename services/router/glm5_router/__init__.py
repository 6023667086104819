"""The router: gRPC + OpenAI-compatible HTTP front door for GLM-5 workers."""
