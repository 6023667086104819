"""One rank of a sharded trainer that syncs its weights into engines over the collective transport, started as
torchrun would (RANK, WORLD_SIZE, ... in the environment) by tests/integration/test_weight_sync.py.

    python -m tests.helpers.sync_trainer --policy DIR --engine ADDR=TP [--engine ...] --version V --out DIR
        [--publish] [--bucket-bytes N] [--die-after-buckets K]

Every rank builds the sharded policy from DIR; with --publish they first publish actor_synced vV under
--out together (the checkpoint the engines' tokens are compared with). Rank 0 then syncs vV to the engines
(glm5_trainer.sync.sync_engines) and writes out/sync.json: per engine its seconds or its error, and rank 0's
peak RSS before and after the sync. --die-after-buckets: rank 0 exits after sending K buckets (a
trainer that dies mid-sync).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
from pathlib import Path

import glm5_trainer.sync as sync_module
import torch
from glm5.tokenizer import Tokenizer
from glm5_trainer.distributed import World, init, leave
from glm5_trainer.policy import Policy
from glm5_trainer.ranks import Ranks
from glm5_trainer.sync import CollectiveSync, sync_engines
from glm5_trainer.versions import WeightVersions

from tests.helpers.procs import ADMIN_TOKEN, INTERNAL_TOKEN


def open_ranks(policy_path: Path, out: Path, timeout_s: float) -> tuple[World, Policy, WeightVersions, Ranks]:
    """This process's rank of a sharded trainer on CPU (one thread), its versions under `out` published every
    step, and the command channel rank 0 drives the others with (also benchmarks/rl_scale.py's ranks)."""
    torch.set_num_threads(1)
    world = World.from_env()
    if world.size > 1:
        init(world, torch.device("cpu"), timeout_s=timeout_s)
    policy = Policy(policy_path, world=world, dtype=torch.float32)
    versions = WeightVersions(policy.model, out, policy_path, sync_every_steps=1)
    return world, policy, versions, Ranks(policy, versions, out / "state", world)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", type=Path, required=True)
    p.add_argument("--engine", action="append", default=[])
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--publish", action="store_true")
    p.add_argument("--bucket-bytes", type=int, default=64 << 10)
    p.add_argument("--die-after-buckets", type=int, default=-1)
    a = p.parse_args()
    world, policy, versions, ranks = open_ranks(a.policy, a.out, timeout_s=60)
    versions.latest = a.version
    if a.publish:
        versions.publish()
    if not world.leader:
        ranks.follow()
        leave()
    if a.die_after_buckets >= 0:
        real = sync_module.pieces

        def dying(model: torch.nn.Module, plan: sync_module.Manifest, rank: int):  # type: ignore[no-untyped-def]
            for i, bucket in enumerate(real(model, plan, rank)):
                if i == a.die_after_buckets:
                    os._exit(3)
                yield bucket

        sync_module.pieces = dying  # type: ignore[assignment]
    engines = {e.rsplit("=", 1)[0]: int(e.rsplit("=", 1)[1]) for e in a.engine}
    sync = CollectiveSync("127.0.0.1", 0, timeout_s=30, bucket_bytes=a.bucket_bytes)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fingerprint = Tokenizer(a.policy).fingerprint
    results = asyncio.run(sync_engines(ranks, sync, engines, a.version, fingerprint, admin_token=ADMIN_TOKEN,
                                       internal_token=INTERNAL_TOKEN))  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ranks.stop()
    pairs = list(zip(engines, results, strict=True))
    seconds = {e: r[e] for e, r in pairs if not isinstance(r, BaseException)}
    errors = {e: str(r) for e, r in pairs if isinstance(r, BaseException)}
    plan = sync_module.manifest(policy.model, a.version, a.bucket_bytes, world.size)
    summary = {"seconds": seconds, "errors": errors, "rss": [before, after], "buckets": len(plan.buckets)}
    (a.out / "sync.json").write_text(json.dumps(summary))
    sync.close()
    leave()


if __name__ == "__main__":
    main()
