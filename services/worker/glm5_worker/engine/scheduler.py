"""Continuous batching with a per-step token budget and chunked prefill.

Each step: every running sequence that is decoding gets one token (decode first: it keeps inter-token
latency flat); sequences part-way through their prompt continue with a chunk; then waiting sequences are
admitted in arrival order while the budget, the sequence cap and the KV pool allow. When the pool runs out
during decode, the most recently admitted sequence is preempted: its blocks are freed (full ones stay in the
prefix cache) and it is recomputed later from its tokens, like vLLM's recompute preemption.

A waiting sequence whose next uncached block is one a running sequence is still computing (a burst of requests
sharing a system prompt) waits until that block is computed and cached, then finds it there, like SGLang's
in-batch prefix caching: computing the same prefix twice in one step costs the step its time and the cache a
hit. Sequences behind it are admitted meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from glm5_worker.engine.sequence import FinishReason, Sequence
from glm5_worker.kv.block_manager import BlockManager


@dataclass(slots=True)
class ScheduledStep:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_deferred = 0  # admissions put off to find a prefix another sequence was computing

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drops a finished or aborted sequence and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_ids, seq.draft_probs = [], []
        self.blocks.free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.budget
        for seq in list(self.running):
            if seq not in self.running or seq.num_uncomputed != 1:
                continue
            # a sequence with drafts verifies them in this step: one row per draft more (glm5_worker.engine.
            # speculative); short of blocks, it drops them before anything is preempted
            if seq.draft_ids and not self.blocks.ensure_slots(seq, 1 + len(seq.draft_ids)):
                seq.draft_ids, seq.draft_probs = [], []
            while not self.blocks.ensure_slots(seq, 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                step.decodes.append(seq)
                budget -= 1 + len(seq.draft_ids)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_uncomputed > 1:
                n = min(seq.num_uncomputed, budget)
                if self.blocks.ensure_slots(seq, n):
                    step.prefills.append((seq, n))
                    budget -= n
        admits = self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        computing = self._computing() if admits and self.blocks.prefix_caching else set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            # prompt logprobs need the logits of every prompt token: no cached prefix for them
            matched = None if seq.params.prompt_logprobs else self.blocks.match_prefix(seq)
            nxt = len(seq.block_table)
            if matched is not None and nxt < len(seq.block_hashes) and seq.block_hashes[nxt] in computing:
                self.blocks.unmatch(seq, matched)
                deferred.append(seq)
                self.num_deferred += 1
                continue
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.ensure_slots(seq, n):
                # a waiting sequence holds no blocks: the prefix it matched goes back (still cached, matched
                # again next step). Kept, the matches of preempted sequences queued in front of each other held
                # the pool between them with nothing running, for good.
                self.blocks.unmatch(seq, matched)
                self.waiting.appendleft(seq)
                break
            if not seq.output_ids:
                seq.num_cached_prompt_tokens = matched or 0
            self.running.append(seq)
            step.prefills.append((seq, n))
            budget -= n
            computing.update(seq.block_hashes[seq.num_registered_blocks :])
        self.waiting.extendleft(reversed(deferred))
        return step

    def _computing(self) -> set[bytes]:
        """The hashes of the prompt blocks running sequences have yet to compute (cached once they have)."""
        return {h for seq in self.running for h in seq.block_hashes[seq.num_registered_blocks :]}

    def abort_all(self) -> list[Sequence]:
        seqs = [*self.running, *self.waiting]
        for seq in seqs:
            seq.finish_reason = FinishReason.ABORT
            self.remove(seq)
        return seqs
