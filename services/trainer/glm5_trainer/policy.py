"""The policy being trained: transformers' GlmMoeDsaForCausalLM (the reference implementation our engine
matches to 1e-4, with the autograd path), its optimizer, and one RL step over selected rollout records.

A step: recompute the log-probs of the rollout tokens under the current weights, group-normalised advantages
from the rewards, the double-sided importance-sampling loss against the engine's rollout log-probs, the MoE
expert-balance and router-entropy terms (captured from every router by a forward hook), then non-finite
gradients zeroed per parameter and adaptive clipping before the optimizer step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import math
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from glm5.errors import ConfigError
from glm5.model.loader import checkpoint_files
from glm5.v1 import tito_pb2

from glm5_trainer.distributed import World, all_sum, build_sharded, init, split_by_tokens
from glm5_trainer.loss import TrustRegion, group_advantages, policy_loss
from glm5_trainer.stability import adaptive_clip, expert_balance_loss, router_entropy_loss, zero_nonfinite_grads


class MalformedBatch(ValueError):
    """A batch the trainer refuses to train on (it never trains on part of one silently)."""


@dataclass(frozen=True, slots=True)
class StepStats:
    loss: float
    policy_loss: float
    aux_loss: float
    reward: float  # mean over the batch
    tokens: int  # model tokens
    kept: int  # inside the trust region
    clipped_low: int
    clipped_high: int
    mismatch: float  # mean |logp_trainer - logp_rollout| over model tokens, before the update
    nonfinite_grads: int
    clipped_tensors: int


@dataclass
class Batch:
    ids: torch.Tensor  # (N, T) right-padded
    attention: torch.Tensor  # (N, T)
    mask: torch.Tensor  # (N, T-1): 1 where token t+1 is a model token
    rollout_logp: torch.Tensor  # (N, T-1)
    rewards: torch.Tensor  # (N,)
    groups: torch.Tensor  # (N,)

    def rows(self, index: list[int]) -> Batch:
        """The batch's rows `index`, cut to their longest (the group ids stay the whole batch's)."""
        i = torch.tensor(index, dtype=torch.long)
        width = int(self.attention[i].sum(dim=1).max())
        return Batch(self.ids[i, :width], self.attention[i, :width], self.mask[i, : width - 1],
                     self.rollout_logp[i, : width - 1], self.rewards[i], self.groups[i])  # fmt: skip


def make_batch(records: list[tito_pb2.RolloutRecord], vocab_size: int) -> Batch:
    if not records:
        raise MalformedBatch("empty batch")
    for r in records:
        n = len(r.token_ids)
        if n < 2 or len(r.loss_mask) != n or len(r.logprobs) != n:
            raise MalformedBatch(f"rollout {r.rollout_id!r}: token ids, loss mask and logprobs must agree (>= 2)")
        if min(r.token_ids) < 0 or max(r.token_ids) >= vocab_size:
            raise MalformedBatch(f"rollout {r.rollout_id!r}: a token id outside the vocabulary (0..{vocab_size - 1})")
        if r.loss_mask[0]:
            raise MalformedBatch(f"rollout {r.rollout_id!r}: the first token cannot be a model token")
        if not all(math.isfinite(x) and x <= 1e-4 for x in r.logprobs):
            raise MalformedBatch(f"rollout {r.rollout_id!r}: logprobs must be finite and <= 0")
        if not math.isfinite(r.reward):
            raise MalformedBatch(f"rollout {r.rollout_id!r}: reward is not finite")
    width = max(len(r.token_ids) for r in records)

    def pad(xs: Any, value: float = 0) -> list[Any]:
        return [*xs, *([value] * (width - len(xs)))]

    ids = torch.tensor([pad(r.token_ids) for r in records], dtype=torch.long)
    attention = torch.tensor([pad([1] * len(r.token_ids)) for r in records], dtype=torch.long)
    mask = torch.tensor([pad(r.loss_mask) for r in records], dtype=torch.float32)[:, 1:]
    logp = torch.tensor([pad(r.logprobs) for r in records], dtype=torch.float32)[:, 1:]
    group_index: dict[str, int] = {}
    groups = torch.tensor([group_index.setdefault(r.group_id, len(group_index)) for r in records])
    rewards = torch.tensor([r.reward for r in records], dtype=torch.float32)
    return Batch(ids, attention, mask, logp, rewards, groups)


@dataclass
class Policy:
    path: Path
    learning_rate: float = 1e-4
    region: TrustRegion = field(default_factory=lambda: TrustRegion.preset("math"))
    balance_weight: float = 0.02
    entropy_weight: float = 0.005
    clip_factor: float = 0.85
    total_steps: int | None = None  # with a cosine schedule: the learning rate decays to 0 over these steps
    steps_done: int = 0  # a resumed job: the schedule continues where it stopped
    nonfinite: collections.Counter[str] = field(default_factory=collections.Counter)
    world: World = field(default_factory=World)  # > 1 rank: FSDP2 over the world (glm5_trainer.distributed)
    dtype: torch.dtype = torch.float32
    # recompute each decoder layer's activations in the backward pass instead of keeping them (transformers'
    # activation checkpointing, non-reentrant, so FSDP2 gathers the layer again for the recompute)
    activation_checkpointing: bool = False
    # several ranks: the routed experts split over them by expert, the tokens sent to them (glm5_trainer.experts)
    expert_parallel: bool = True
    _saver: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="glm5-state")
    )
    _save: concurrent.futures.Future[None] | None = None

    def __post_init__(self) -> None:
        try:
            import transformers
            from transformers import GlmMoeDsaForCausalLM
        except ImportError as exc:
            raise ConfigError("the trainer needs its extra: pip install -e '.[trainer]'") from exc
        # The lightning indexer's top-k (and MoE routing) must pick the same tokens for the same inputs, or
        # recomputed log-probs stop matching the engine's: deterministic kernels for the whole trainer.
        torch.use_deterministic_algorithms(True)
        transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call] # one bar per published version is noise
        # torch's grouped matmul (transformers' default for the experts) takes no float64: the tests' dtype
        extra: dict[str, Any] = {"experts_implementation": "eager"} if self.dtype == torch.float64 else {}
        if self.world.size > 1:
            init(self.world, torch.device("cpu"))
            self.model, self.loaded_bytes = build_sharded(
                self.path, self.dtype, torch.device("cpu"), expert_parallel=self.expert_parallel, **extra
            )
        else:
            self.model = GlmMoeDsaForCausalLM.from_pretrained(self.path, dtype=self.dtype, **extra)
            self.loaded_bytes = sum(f.stat().st_size for f in checkpoint_files(self.path))  # all of it
        if self.activation_checkpointing:
            self.model.activation_checkpointing_enable({"use_reentrant": False})
        self.model.train()
        self.vocab_size = int(self.model.config.vocab_size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate, weight_decay=0.0,
                                           betas=(0.9, 0.98))  # fmt: skip
        self.scheduler = (
            torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=self.total_steps)
            if self.total_steps
            else None
        )
        if self.scheduler is not None and self.steps_done:
            with warnings.catch_warnings():  # stepping the schedule ahead of the optimizer is the point here
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(self.steps_done):
                    self.scheduler.step()
        self._routers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._capturing = False  # the forward pass only: a checkpointed layer's recompute runs the router again
        for module in self.model.modules():
            if type(module).__name__.endswith("TopkRouter"):
                module.register_forward_hook(self._capture_router)

    def save_state(self, path: Path, version: int) -> None:
        """The optimizer's (and schedule's) state for the weights of `version`, replacing the previous one
        atomically: a trainer restarted on the same volume resumes exactly, and only one copy (twice the
        parameters, for AdamW) is kept. The state is copied here and written by a background thread, off the
        training step's path; `wait_saved` waits for the writes."""
        if self.world.size > 1:
            self._save_sharded_state(path, version)
            return
        state = {
            "version": version,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),  # the next step updates it in place
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

        def write() -> None:
            tmp = path.with_name(path.name + ".tmp")
            torch.save(state, tmp)
            tmp.replace(path)

        self.wait_saved()  # at most one copy in flight: a slow disk slows publishing, not memory
        self._save = self._saver.submit(write)

    def wait_saved(self) -> None:
        """Blocks until the last saved state is on disk (raises if the write failed)."""
        save, self._save = self._save, None
        if save is not None:
            save.result()

    def load_state(self, path: Path, version: int) -> bool:
        """Restores the state saved with `version`; False (fresh optimizer) when there is none for it."""
        if self.world.size > 1:
            return self._load_sharded_state(path, version)
        if not path.is_file():
            return False
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("version") != version:
            return False
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        return True

    def _save_sharded_state(self, folder: Path, version: int) -> None:
        """Several ranks: the state as a DCP directory (`save_checkpoint`), written by every rank and swapped in by
        rank 0 once complete; `version` beside it says which published weights it goes with. Synchronous: the
        ranks' shards are written in parallel, and no rank holds a copy of the whole."""
        tmp = folder.with_name(folder.name + ".tmp")
        if self.world.leader:
            shutil.rmtree(tmp, ignore_errors=True)
        torch.distributed.barrier()
        self.save_checkpoint(tmp, version)
        torch.distributed.barrier()  # every rank's shards are written, not only rank 0's metadata
        if self.world.leader:
            (tmp / "version").write_text(f"{version}\n")
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)

    def _load_sharded_state(self, folder: Path, version: int) -> bool:
        saved: list[Any] = [None]
        if self.world.leader:
            with contextlib.suppress(OSError, ValueError):
                saved[0] = int((folder / "version").read_text())
        torch.distributed.broadcast_object_list(saved, src=0)  # one decision for every rank
        if saved[0] != version:
            return False
        self.load_checkpoint(folder)
        return True

    def save_checkpoint(self, path: Path, version: int) -> None:
        """The whole trainer state (weights, AdamW's moments, the schedule, the version) as a
        torch.distributed.checkpoint directory that every rank writes its own shards of, in parallel; it
        resumes on any world size (`load_checkpoint`: DCP reshards)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save

        model, optimizer = get_state_dict(self.model, self.optimizer)
        trainer = {"version": version, "scheduler": self.scheduler.state_dict() if self.scheduler else None}
        save({"model": model, "optimizer": optimizer, "trainer": trainer}, checkpoint_id=path)

    def load_checkpoint(self, path: Path) -> int:
        """Restores a `save_checkpoint` directory written at any world size; returns its version."""
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        model, optimizer = get_state_dict(self.model, self.optimizer)
        # parameters that never had a gradient (the indexer's, outside the autograd graph) have no AdamW state in
        # the checkpoint, while a fresh optimizer's template has one for every parameter: load what was saved
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
        moments = cast(dict[str, Any], optimizer["state"])
        optimizer["state"] = {k: v for k, v in moments.items() if f"optimizer.state.{k}.step" in saved}
        trainer: dict[str, Any] = {"version": -1, "scheduler": self.scheduler.state_dict() if self.scheduler else None}
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "trainer": trainer}
        load(state, checkpoint_id=path)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(strict=False),
        )  # dcp.load was strict: every key asked for is there
        if self.scheduler is not None and state["trainer"]["scheduler"] is not None:
            self.scheduler.load_state_dict(state["trainer"]["scheduler"])
        return int(state["trainer"]["version"])

    def _capture_router(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._capturing:
            logits, _, topk_idx = output
            self._routers.append((logits, topk_idx))

    def token_logprobs(self, batch: Batch) -> torch.Tensor:
        """(N, T-1) log-probs of each next token under the current weights (with grad)."""
        self._routers.clear()
        self._capturing = True
        try:
            logits = self.model(input_ids=batch.ids, attention_mask=batch.attention).logits
        finally:
            self._capturing = False
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least; float64 stays
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        return logp.gather(-1, batch.ids[:, 1:, None]).squeeze(-1)

    def aux_loss(self, batch: Batch, tokens: int | None = None) -> torch.Tensor:
        """Expert-balance + router-entropy terms, averaged over the MoE layers, over real (unpadded) tokens.
        On a rank training on part of a batch of `tokens` real tokens: its share (the experts' counts summed
        over the world first)."""
        if not self._routers:
            return torch.zeros(())
        valid = batch.attention.flatten().bool()
        num_experts = self._routers[0][0].shape[-1]
        counts = torch.stack([torch.bincount(idx[valid].flatten(), minlength=num_experts) for _, idx in self._routers])
        if self.world.size > 1:
            torch.distributed.all_reduce(counts)
        total = torch.zeros((), dtype=self.dtype)
        for (logits, topk_idx), c in zip(self._routers, counts, strict=True):
            probs = logits[valid].sigmoid()
            total = total + expert_balance_loss(probs, topk_idx[valid], self.balance_weight, c, tokens)
            total = total + router_entropy_loss(probs, self.entropy_weight, tokens)
        return total / len(self._routers)

    def step(self, records: list[tito_pb2.RolloutRecord]) -> StepStats:
        """One update on the whole batch. With several ranks every rank passes the same records and trains on
        its rows (`split_by_tokens`); advantages, token counts and expert counts are the whole batch's, so the
        summed gradients and the returned stats are what one process gets."""
        batch = make_batch(records, self.vocab_size)
        reward = float(batch.rewards.mean())
        advantages = group_advantages(batch.rewards, batch.groups)
        model_tokens, real_tokens = int(batch.mask.sum()), int(batch.attention.sum())
        weight = 1.0
        if self.world.size > 1:
            mine = split_by_tokens([len(r.token_ids) for r in records], self.world.size)[self.world.rank]
            weight = 1.0 if mine else 0.0  # fewer rows than ranks: a row's forward, for FSDP's collectives
            batch, advantages = batch.rows(mine or [0]), advantages[torch.tensor(mine or [0])]
        logp = self.token_logprobs(batch)
        mine_tokens = batch.mask.bool()
        mismatch_sum = float((logp.detach() - batch.rollout_logp).abs()[mine_tokens].sum()) * weight
        stats = policy_loss(logp, batch.rollout_logp, advantages, batch.mask, self.region, tokens=model_tokens)
        aux = self.aux_loss(batch, real_tokens if self.world.size > 1 else None)
        loss = (stats.loss + aux) * weight
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        zeroed = zero_nonfinite_grads(self.model, self.nonfinite)
        clipped = adaptive_clip(self.model, self.clip_factor)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        total, policy, aux_total, mismatch, kept, low, high = all_sum(
            [float(loss.detach()), float(stats.loss.detach()) * weight, float(aux.detach()) * weight, mismatch_sum,
             stats.kept * weight, stats.clipped_low * weight, stats.clipped_high * weight]
        )  # fmt: skip
        return StepStats(
            loss=total, policy_loss=policy, aux_loss=aux_total, reward=reward, tokens=model_tokens, kept=int(kept),
            clipped_low=int(low), clipped_high=int(high),
            mismatch=mismatch / max(model_tokens, 1), nonfinite_grads=zeroed, clipped_tensors=clipped,
        )  # fmt: skip

    @torch.no_grad()
    def recompute(self, records: list[tito_pb2.RolloutRecord]) -> list[list[float]]:
        """The trainer's log-probs of each record's model tokens (what the engine's rollout log-probs must
        equal under the same weights)."""
        batch = make_batch(records, self.vocab_size)
        logp = self.token_logprobs(batch)
        return [logp[i][batch.mask[i].bool()].tolist() for i in range(len(records))]
