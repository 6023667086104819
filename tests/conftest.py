"""Shared fixtures: an isolated GLM5_HOME and small checkpoints built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from glm5.grpc_env import default_grpc_experiments

# the gRPC I/O path the glm5 command uses (glm5_cli/__init__.py), for the servers and clients tests run in-process
default_grpc_experiments()
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Engines (and the workers the tests start) run eagerly: compiling each one's decode steps would cost minutes.
# tests/unit/worker/test_compiled_decode.py asks for compiled steps explicitly.
os.environ.setdefault("GLM5_ENFORCE_EAGER", "1")
if not torch.cuda.is_available():
    # Triton reads this when it is first imported and when a kernel runs: without a GPU, the Triton kernels run
    # under its CPU interpreter (tests/unit/kernels); with one they are compiled and run on it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def glm5_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("glm5-home")
    os.environ["GLM5_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glm5.model.presets import init_model

    return init_model(tmp_path_factory.mktemp("tiny") / "glm5-tiny", preset="tiny", seed=0)
