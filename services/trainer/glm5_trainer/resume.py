"""Where a (re)started trainer begins: the newest published version under the output folder, the steps the job
has taken, and the completion an RLJob's operator reads once it has taken them all."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from glm5_trainer.config import RLConfig
from glm5_trainer.distributed import World
from glm5_trainer.policy import Policy
from glm5_trainer.ranks import Ranks
from glm5_trainer.versions import WeightVersions, steps_recorded


def latest_published(out: Path) -> tuple[int, Path] | None:
    """The newest complete actor_synced checkpoint under `out` (publishing is atomic: `.tmp` folders are not)."""
    versions = []
    for d in (out / "actor_synced").glob("v*"):
        if d.is_dir() and d.name[1:].isdigit() and (d / "config.json").is_file():
            versions.append((int(d.name[1:]), d))
    return max(versions) if versions else None


def finished(config: RLConfig) -> tuple[int, int] | None:
    """(version, steps) when the job has already taken its `steps` (a trainer restarted after it finished; a
    StatefulSet restarts every container that exits), else None. Read from the published versions alone, so
    every host can tell before any rank starts: a finished job needs no rendezvous."""
    latest = latest_published(config.out)
    if not config.steps or latest is None:
        return None
    recorded = steps_recorded(latest[1])
    steps = recorded if recorded is not None else latest[0]
    return (latest[0], steps) if steps >= config.steps else None


def report_finished(config: RLConfig, version: int, steps: int) -> None:
    """The completion an RLJob's operator reads (the container's termination message)."""
    if config.completion_file is not None:
        done = {"complete": True, "steps": steps, "version": version}
        config.completion_file.write_text(json.dumps(done) + "\n")


@dataclass
class Trainer:
    """What every trainer rank builds the same way: the policy (sharded over the world), its weight versions,
    and where a restarted job resumes."""

    ranks: Ranks
    resumed_from: tuple[int, Path] | None
    steps_done: int
    exact_resume: bool


def open_trainer(config: RLConfig, world: World) -> Trainer:
    """The policy and its versions on this rank. A restarted trainer (an RLJob pod) resumes from its last
    published version, not from the start; the optimizer state saved with that version too, when there is
    one (rank 0 and the other ranks call this alike: the resume's reads are collective)."""
    resumed_from = latest_published(config.out)
    start = config.policy if resumed_from is None else resumed_from[1]
    # `steps` counts the job's steps across restarts; versions published before they were recorded count one
    # step per version (0 is a real count: the starting policy published above the engines' version)
    recorded = None if resumed_from is None else steps_recorded(start)
    done = 0 if resumed_from is None else recorded if recorded is not None else resumed_from[0]
    policy = Policy(start, config.learning_rate, config.region, config.balance_weight, config.entropy_weight,
                    total_steps=config.steps if config.lr_schedule == "cosine" else None, steps_done=done,
                    world=world, activation_checkpointing=config.activation_checkpointing,
                    expert_parallel=config.expert_parallel)  # fmt: skip
    versions = WeightVersions(policy.model, config.out, config.policy, config.sync_every_steps,
                              config.sync_interval_s, config.ema_decay, steps=done)  # fmt: skip
    # one rank: the optimizer's state as one file; several: a DCP directory every rank writes its part of
    state_path = config.out / ("trainer_state.pt" if world.size == 1 else "trainer_state")
    ranks = Ranks(policy, versions, state_path, world)
    exact = False
    if resumed_from is not None:
        versions.latest = versions.synced = resumed_from[0]
        exact = ranks.restore(resumed_from[0])
    return Trainer(ranks, resumed_from, done, exact)
