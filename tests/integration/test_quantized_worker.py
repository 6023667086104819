"""`glm5 worker --dtype float32 --enforce-eager` serving quantized checkpoints whose sizes are not multiples of
their blocks or groups, on one device and as a two-rank replica (its own follower process, gloo): the prompt
log-probs it returns over gRPC equal transformers' on the dequantized weights within 1e-4
(tests/unit/model/test_quantized_parity.py builds the checkpoints and their float twins)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from glm5.client import sampling
from glm5.tokenizer.build import write_tokenizer
from glm5.v1 import worker_pb2, worker_pb2_grpc

from tests.helpers.procs import start_worker, stop

# skips this module where compressed-tensors is not installed, as that one does
from tests.unit.model.test_quantized_parity import TOLERANCE, Checkpoints, parity_ids, transformers_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.oracle]
ARGS = ("--dtype", "float32", "--enforce-eager", "--dense-warmup-tokens", "0", "--kv-cache-bytes", "16MiB",
        "--max-model-len", "256", "--block-size", "16", "--collective-timeout", "30")  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("quantized-worker"))


def prompt_logprobs(target: str, ids: list[int]) -> list[float]:
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        params = sampling(temperature=0.0, max_new_tokens=1, ignore_eos=True)
        req = worker_pb2.GenerateRequest(prompt_token_ids=ids, return_prompt_logprobs=True, sampling=params)
        return [p.logprob for r in stub.Generate(req, timeout=120) for p in r.prompt_logprobs]


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("fp8-block", ()),  # GLM-5-FP8's layout, 128 x 128 blocks all partial
        ("fp8-block-routed-experts", ("-tp", "2")),  # experts partitioned: each rank holds whole experts
        ("w4a16-fp8-mix-split", ("-tp", "2", "--no-expert-parallel")),  # experts split into whole groups / blocks
        ("int4-channel", ("-tp", "2", "--no-expert-parallel")),  # channel scales read whole by both ranks
    ],
)
def test_worker_prompt_logprobs_match_transformers(
    checkpoints: Checkpoints, tmp_path: Path, name: str, extra: tuple[str, ...]
) -> None:
    quantized, reference = checkpoints(name)
    write_tokenizer(quantized)
    want = transformers_logprobs(reference)
    ids = parity_ids(want.shape[1])
    log = tmp_path / "worker.log"
    proc, target = start_worker(quantized, *ARGS, *extra, log=log)
    try:
        got = prompt_logprobs(target, ids)
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    assert len(got) == len(ids) - 1
    expected = torch.tensor([want[i, ids[i + 1]].item() for i in range(len(ids) - 1)])
    assert (torch.tensor(got) - expected).abs().max().item() <= TOLERANCE
