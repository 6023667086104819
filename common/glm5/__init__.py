"""Shared code of the GLM-5 stack: model, kernels, checkpoints, tokenizer, generated gRPC stubs."""
