"""One rank of a sharded trainer, started as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT in the environment) by tests/integration/test_trainer_fsdp.py.

    python -m tests.helpers.trainer_rank --model DIR --records FILE --out DIR
        [--steps 1] [--skip-steps N] [--save-after N --checkpoint DIR] [--resume DIR] [--die-at-step N] [--timeout 60]
        [--publish DIR] [--activation-checkpointing] [--no-expert-parallel]

Trains `--steps` steps (float64) on the same records, then writes out/rank{R}.pt: this rank's state bytes, the
bytes it read of the checkpoint and the steps' stats; rank 0 also writes out/weights.pt, the full updated
weights gathered for the comparison.
--publish: then every rank publishes actor_synced v1 under DIR together (WeightVersions.publish); a world of
one also writes transformers' own save_pretrained of the same weights to DIR/hf.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from glm5.v1 import tito_pb2
from glm5_trainer.distributed import World, init, leave, state_bytes
from glm5_trainer.experts import ExpertParallel
from glm5_trainer.policy import Policy
from glm5_trainer.versions import WeightVersions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--records", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--skip-steps", type=int, default=0, help="a resumed run: start at this step")
    p.add_argument("--save-after", type=int, default=0)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--resume", type=Path)
    p.add_argument("--die-at-step", type=int, default=-1, help="rank 1 exits at the start of this step")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--publish", type=Path)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-expert-parallel", dest="expert_parallel", action="store_false")
    a = p.parse_args()
    torch.set_num_threads(1)
    world = World.from_env()
    if world.size > 1:
        init(world, torch.device("cpu"), timeout_s=a.timeout)
    batches = torch.load(a.records, weights_only=False)
    records = [[tito_pb2.RolloutRecord.FromString(r) for r in batch] for batch in batches]
    policy = Policy(a.model, learning_rate=1e-3, world=world, dtype=torch.float64, total_steps=4,
                    activation_checkpointing=a.activation_checkpointing, expert_parallel=a.expert_parallel)  # fmt: skip
    # AdamW's first step moves each weight by lr * g / (|g| + eps): with the default eps (1e-8) a gradient near
    # 1e-8 turns transformers' float32 rounding (norms, softmax and router run in float32 whatever the dtype,
    # and round differently for other batch shapes on some CPUs) into weight differences of 1e-6. With eps 1e-3
    # the update is linear in the gradient, so the weights compare the summed gradients themselves.
    for group in policy.optimizer.param_groups:
        group["eps"] = 1e-3
    if a.resume:
        policy.load_checkpoint(a.resume)
    stats = []
    for step in range(a.skip_steps, a.steps):
        if step == a.die_at_step and world.rank == 1:
            os._exit(3)
        stats.append(policy.step(records[step % len(records)]))
        if a.save_after and step + 1 == a.save_after:
            policy.save_checkpoint(a.checkpoint, version=step + 1)
    written: dict[str, int] = {}
    if a.publish:
        versions = WeightVersions(policy.model, a.publish, a.model, sync_every_steps=1)
        versions.advance()
        versions.publish()
        written = versions.written
        if world.size == 1:
            policy.model.save_pretrained(a.publish / "hf")
    full = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    a.out.mkdir(parents=True, exist_ok=True)
    mine = {"bytes": state_bytes(policy.model, policy.optimizer), "stats": stats, "read": policy.loaded_bytes,
            "checkpointing": bool(policy.model.is_activation_checkpointing),
            "expert_parallel": any(isinstance(m, ExpertParallel) for m in policy.model.modules()),
            "published": written}  # fmt: skip
    torch.save(mine, a.out / f"rank{world.rank}.pt")
    if world.leader:
        torch.save(full, a.out / "weights.pt")
    leave()


if __name__ == "__main__":
    main()
