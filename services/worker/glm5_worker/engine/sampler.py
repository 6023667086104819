"""Turns logits into tokens: penalties (repetition, presence, frequency), logit bias, structured-output masks,
temperature, top-k, top-p, seeded sampling, logprobs.

Logprobs are those of the raw distribution (log_softmax of the model's logits, temperature 1, before any
filtering), which is what an RL trainer recomputes. A request with a seed draws from its own generator, so
its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from glm5_worker.engine.sequence import Sequence, TokenLogprob
from glm5_worker.engine.structured import allowed_tokens


class Sampler:
    def __init__(self, seed: int, device: torch.device, eos_token_ids: list[int] | None = None) -> None:
        self.device = device
        self.eos_token_ids = list(eos_token_ids or [])  # masked while a sequence is below its min_tokens
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[TokenLogprob]:
        """logits (B, V) float32 -> one token (with its logprob) per sequence."""
        logits = logits.float()
        need_lp = any(s.params.logprobs for s in seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if need_lp else None
        processed = self.constrain(self._penalise(logits, seqs), seqs)
        greedy = [s.params.is_greedy for s in seqs]
        tokens: list[int] = []
        if all(greedy):
            tokens = processed.argmax(dim=-1).tolist()
        else:
            probs = self.filtered_probs(processed, seqs)
            drawn = self._draw(probs, seqs).tolist()
            argmax = processed.argmax(dim=-1).tolist()
            tokens = [argmax[i] if greedy[i] else drawn[i] for i in range(len(seqs))]
        out: list[TokenLogprob] = []
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if raw_logprobs is not None and seq.params.logprobs:
                out.append(token_logprob(raw_logprobs[i], token, seq.params.top_logprobs))
            else:
                out.append(TokenLogprob(token, 0.0))
        return out

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row by inverse-CDF sampling: one uniform per row, from the request's own generator
        when it has a seed (batch-independent), then a single batched cumsum + searchsorted; one
        `torch.multinomial` per row cost ~50 us each, most of a batch-64 step's sampling time."""
        u = torch.empty(len(seqs), dtype=torch.float64)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                u[i] = torch.rand(1, generator=seq.generator, dtype=torch.float64)
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64)
        cdf = probs.double().cumsum(dim=-1)
        target = (u.to(probs.device) * cdf[:, -1])[:, None]
        picked = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
        # u * total can round up to the total itself: fall back to the most likely token, never a filtered one
        zero = probs.gather(1, picked).squeeze(1) <= 0
        if bool(zero.any()):
            picked[zero] = probs[zero].argmax(dim=-1, keepdim=True)
        return picked.squeeze(1).cpu()

    def _penalise(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        if all(_unpenalised(s) and not _below_min(s) for s in seqs):
            return logits
        logits = logits.clone()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.repetition_penalty != 1.0:
                # CTRL (Keskar et al. 2019): divide positive logits, multiply negative ones
                ids = torch.tensor(sorted(set(seq.all_token_ids)), dtype=torch.long, device=logits.device)
                row = logits[i, ids]
                logits[i, ids] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
                # OpenAI's: over generated tokens only, once per token plus once per occurrence
                out = torch.tensor(seq.output_ids, dtype=torch.long, device=logits.device)
                counts = torch.zeros(logits.shape[-1], device=logits.device).index_add_(
                    0, out, torch.ones(out.shape[0], device=logits.device)
                )
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
            if _below_min(seq):
                ending = {*p.stop_token_ids} | (set() if p.ignore_eos else {*self.eos_token_ids})
                logits[i, sorted(ending)] = float("-inf")
        return logits

    @staticmethod
    def constrain(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Structured output: -inf for every token a constrained sequence's format does not allow next."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None and s.format_phase != "thinking"]
        if not rows:
            return logits
        matchers = [seqs[i].matcher for i in rows]
        allowed = allowed_tokens([m for m in matchers if m is not None], logits.shape[-1]).to(logits.device)
        for k, i in enumerate(rows):
            fmt = seqs[i].params.output_format
            if fmt is not None and fmt.think_open is not None and seqs[i].format_phase == "start":
                allowed[k, fmt.think_open] = True  # the output may open with a thinking block
        # a row with nothing allowed: its matcher failed, and the engine ends the sequence after this token
        allowed[~allowed.any(dim=1)] = True
        logits = logits.clone()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits

    def filtered_probs(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, then top-k and top-p."""
        temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=logits.device)
        logits = logits / temps[:, None]
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
            ranks = torch.arange(vocab, device=logits.device)[None]
            remove = ranks >= ks[:, None]
            sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            ps = torch.tensor(top_p, device=logits.device)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            remove |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= ps[:, None]
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return torch.softmax(logits, dim=-1)


def _unpenalised(seq: Sequence) -> bool:
    p = seq.params
    no_output_penalty = not seq.output_ids or (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)
    return p.repetition_penalty == 1.0 and no_output_penalty and not p.logit_bias


def _below_min(seq: Sequence) -> bool:
    return len(seq.output_ids) < seq.params.min_tokens


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """logprobs (V,) -> the token's logprob and the `top` most likely alternatives."""
    alts: list[tuple[int, float]] = []
    if top > 0:
        values, ids = logprobs.topk(top)
        alts = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), alts)
