"""Every trainer rank runs the same policy and weight versions; rank 0 alone runs the RL loop (gateway, buffer,
engines, status) and drives the others. Each call below is one command: rank 0 broadcasts it
(distributed.Commands) and then runs it, while every other rank, in `follow`, receives and runs the same, so
the collectives inside (FSDP's gathers and reductions, the cooperative publish, DCP) meet in one order.

In a world of one nothing is broadcast: the calls are the policy's and the versions' own.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from glm5.v1 import tito_pb2

from glm5_trainer.distributed import Commands, World, state_bytes
from glm5_trainer.policy import Policy, StepStats
from glm5_trainer.sync import CollectiveSync, manifest, open_groups, send_weights
from glm5_trainer.versions import WeightVersions

log = logging.getLogger(__name__)


class Ranks:
    def __init__(self, policy: Policy, versions: WeightVersions, state_path: Path, world: World) -> None:
        self.policy, self.versions, self.state_path, self.world = policy, versions, state_path, world
        self.commands = Commands(world)
        self._stopped = False

    def _run(self, name: str, *args: Any) -> Any:
        self.commands.send(name, *args)
        return getattr(self, f"_{name}")(*args)

    # -- what rank 0 calls ------------------------------------------------------------------------------

    def step(self, records: list[tito_pb2.RolloutRecord]) -> StepStats:
        """One optimizer step on the whole batch (each rank trains on its rows) and actor_latest moves on."""
        stats: StepStats = self._run("step", [r.SerializeToString() for r in records])
        return stats

    def publish(self) -> Path:
        """actor_synced at rank 0's current version, every rank writing its files."""
        path: Path = self._run("publish", self.versions.latest, self.versions.steps)
        return path

    def save_state(self, version: int) -> None:
        self._run("save_state", version)

    def sync_weights(self, sync: CollectiveSync, version: int,
                     targets: dict[str, tuple[str, int, threading.Event]]) -> dict[str, str]:  # fmt: skip
        """The current weights over a collective group per engine (glm5_trainer.sync): rank 0 waits for the
        engines' ranks to arrive (the others need not wait on it), then every rank joins the groups that are
        ready and sends its own rows. Returns the engines whose sync failed here, with the error."""
        ready, failed = sync.wait(targets, self.world.size)
        args = (sync.rendezvous, ready, version, sync.bucket_bytes, sync.timeout_s)
        self.commands.send("sync_weights", *args)
        failed.update(self._sync_weights(*args, sync=sync))
        return failed

    def restore(self, version: int) -> bool:
        """The optimizer state saved with `version` (False: none, a fresh optimizer). Every rank calls this
        itself while it builds the trainer, before rank 0 leads: not a command."""
        return self.policy.load_state(self.state_path, version)

    def wait_saved(self) -> None:
        self.policy.wait_saved()  # a world of one writes in the background; sharded saves are synchronous

    def bytes_per_rank(self) -> list[dict[str, int]]:
        """Each rank's parameter, gradient and optimizer-state bytes, in rank order."""
        out: list[dict[str, int]] = self._run("bytes_per_rank")
        return out

    def stop(self) -> None:
        """Releases the other ranks (they return from `follow`); idempotent."""
        if not self._stopped:
            self._stopped = True
            self.commands.send("stop")

    # -- the other ranks --------------------------------------------------------------------------------

    def follow(self) -> None:
        """Runs rank 0's commands until it says stop (a rank other than 0 does nothing else)."""
        while True:
            name, args = self.commands.receive()
            if name == "stop":
                log.info("rank %d: rank 0 is done", self.world.rank)
                return
            getattr(self, f"_{name}")(*args)

    # -- the commands, on every rank --------------------------------------------------------------------

    def _step(self, records: list[bytes]) -> StepStats:
        stats = self.policy.step([tito_pb2.RolloutRecord.FromString(r) for r in records])
        self.versions.advance()
        return stats

    def _publish(self, latest: int, steps: int) -> Path:
        self.versions.latest, self.versions.steps = latest, steps  # rank 0 may have renumbered (adopt_engines)
        return self.versions.publish()

    def _sync_weights(self, rendezvous: str, ready: dict[str, tuple[str, int]], version: int, bucket_bytes: int,
                      timeout_s: float, sync: CollectiveSync | None = None) -> dict[str, str]:  # fmt: skip
        rank, senders = self.world.rank, self.world.size
        groups, failed = open_groups(ready, rank, senders, rendezvous, timeout_s, sync)
        plan = manifest(self.policy.model, version, bucket_bytes, senders)
        failed.update(send_weights(self.policy.model, plan, groups, rank))
        if rank and failed:
            log.warning("rank %d: weight sync of v%d failed for %s", rank, version, failed)
        return failed

    def _save_state(self, version: int) -> None:
        self.policy.save_state(self.state_path, version)

    def _bytes_per_rank(self) -> list[dict[str, int]]:
        mine = {**state_bytes(self.policy.model, self.policy.optimizer), "checkpoint_read": self.policy.loaded_bytes}
        out: list[dict[str, int]] = self.commands.gather(mine)
        return out
