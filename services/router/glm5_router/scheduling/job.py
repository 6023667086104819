"""One request on its way through the router."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from glm5.kvcache.prefix import prompt_block_hashes
from glm5.v1 import worker_pb2

if TYPE_CHECKING:
    from glm5_router.workers.pool import Worker

Lane = Literal["short", "medium", "long"]


@dataclass(eq=False)
class Job:
    id: str
    request: worker_pb2.GenerateRequest  # what the worker gets (prompt_token_ids set)
    prompt_tokens: int
    max_new_tokens: int
    lane: Lane
    deadline: float  # monotonic; the request must have started by then
    affinity_key: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    attempts: int = 0
    started: bool = False  # a token reached the client: never retried after this
    worker: str = ""
    # Set to the worker by the dispatcher when the job's batch is sent; renewed for a retry.
    assigned: asyncio.Future[Worker] | None = None
    done: bool = False
    queued: bool = False
    reasoning_budget: int | None = None  # light thinking: close <think> after this many tokens
    hide_reasoning: bool = False  # thinking off for a model that reasons anyway: its reasoning is not returned
    lone_close_hold: int = 0  # characters of output that wait to see whether a lone </think> makes them reasoning
    failed_on: set[str] = field(default_factory=set)  # workers that failed it (avoided on retry)
    trace_context: Any = None  # the request's server span, parent of the worker-call spans (passed, not current)
    _block_hashes: dict[int, list[bytes]] = field(default_factory=dict)  # per block size, computed once

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The prompt's prefix-block hashes as a worker with `block_size` computes them (glm5.kvcache.prefix)."""
        hashes = self._block_hashes.get(block_size)
        if hashes is None:
            hashes = self._block_hashes[block_size] = prompt_block_hashes(self.request.prompt_token_ids, block_size)
        return hashes

    def shared_entry(self) -> dict[str, Any]:
        """What a router replica taking the job from the shared queue needs to run it (JSON; the deadline on the
        wall clock, which the replicas share). The rest of a job (reasoning budget, parsing) stays with the replica
        that streams it to its client."""
        return {
            "request": self.request.SerializeToString().hex(), "prompt_tokens": self.prompt_tokens,
            "max_new_tokens": self.max_new_tokens, "lane": self.lane, "affinity": self.affinity_key or "",
            "deadline": time.time() + max(0.0, self.deadline - time.monotonic()),
        }  # fmt: skip

    @classmethod
    def from_shared_entry(cls, job_id: str, entry: dict[str, Any]) -> Job:
        request = worker_pb2.GenerateRequest()
        request.ParseFromString(bytes.fromhex(entry["request"]))
        remaining = float(entry["deadline"]) - time.time()
        return cls(job_id, request, int(entry["prompt_tokens"]), int(entry["max_new_tokens"]), entry["lane"],
                   time.monotonic() + max(remaining, 0.0), entry["affinity"] or None)  # fmt: skip

    @property
    def kv_cost(self) -> int:
        """Estimated KV tokens it will hold: what orders the long queue."""
        return self.prompt_tokens + self.max_new_tokens
