from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from glm5.errors import CapacityError, ConfigError
from glm5.model.config import ModelConfig
from glm5.units import parse_bytes
from glm5_worker.config import EngineConfig
from glm5_worker.kv.sizing import CacheSpec, auto_bytes, per_token_bytes, plan_pool

GLM5 = ModelConfig(indexer_types=["full"] * 78, mlp_layer_types=["dense"] * 3 + ["sparse"] * 75)


def spec(max_model_len: int, max_num_seqs: int, int8_tier: bool) -> CacheSpec:
    return CacheSpec(GLM5, torch.bfloat16, None, 64, max_model_len, max_num_seqs, 2048, 128, int8_tier)


def test_mla_bytes_per_token_for_glm5() -> None:
    # latent 512 + rope 64 on 78 layers, 128-dim indexer keys on 78 layers
    assert per_token_bytes(GLM5, torch.bfloat16) == (109_824, 55_380)
    assert per_token_bytes(GLM5, torch.float32)[0] == 219_648


def test_pool_plan_fails_early_when_one_sequence_cannot_fit() -> None:
    with pytest.raises(CapacityError, match="max_model_len=131072"):
        plan_pool(spec(131072, 8, int8_tier=False), 10 << 30)
    plan = plan_pool(spec(131072, 8, int8_tier=True), 20 << 30)
    assert plan.capacity_tokens >= 131072 and plan.total_bytes <= 20 << 30
    assert plan.num_fp_blocks >= 8 * 4  # every running sequence's L1 window


def test_auto_is_bounded_by_need_and_by_memory() -> None:
    need_one = auto_bytes(spec(4096, 1, False), 1 << 50, 0.9, None)
    assert need_one == 4096 * 109_824
    assert auto_bytes(spec(4096, 4, False), 1 << 50, 0.9, None) == 4 * need_one
    assert auto_bytes(spec(4096, 4, False), 100 << 20, 0.5, None) == 50 << 20
    assert auto_bytes(spec(4096, 4, False), 100 << 20, 0.5, 10 << 20) == 10 << 20


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(device="tpu"), "--device"),
        (dict(rope_scaling="yarn"), "--rope-factor"),
        (dict(rope_scaling="yarn", rope_factor=3.0), "power of two"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
        (dict(kv_memory_fraction=1.5), "kv_memory_fraction"),
    ],
)
def test_engine_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_parse_bytes() -> None:
    assert parse_bytes("auto") is None
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("4GiB") == 4 << 30 and parse_bytes("1000") == 1000
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def test_worker_cli_reports_bad_flags_cleanly(tiny_model: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "glm5_cli", "worker", "--model", str(tiny_model), "--port", "0", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    out = run("--rope-scaling", "yarn", "--rope-factor", "3")
    assert out.returncode == 2 and "power of two" in out.stderr and "Traceback" not in out.stderr
    out = run("--kv-cache-bytes", "1MiB")
    assert out.returncode == 2 and "--max-model-len" in out.stderr and "Traceback" not in out.stderr
    out = run("--max-model-len", "999999999")
    assert out.returncode == 2 and "exceeds" in out.stderr
    missing = run("--model", "/nonexistent/model")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
