"""Fits a multi-token-prediction (MTP) layer to a trained model's own greedy outputs, the model frozen.

    glm5 demo-model --from MODEL --mtp-steps 1500 --out DIR     (glm5_cli.demo collects the traces)

The layer is GLM-5's (glm5.model.model.MTPLayer): `eh_proj(cat(enorm(embed(x[p+1])), hnorm(h[p])))`, one decoder
block (MLA + indexer + MoE), `shared_head.norm`, and the model's own LM head and embeddings (shared, frozen).
Row p of a trace predicts the token two ahead, x[p+2], from the main model's last hidden state at p (after its
final norm) and the next token, which is what the engine's drafter computes (glm5_worker.engine.speculative).
The block trains as a one-layer transformers model (its final norm is shared_head.norm), the oracle
tests/unit/model/test_mtp.py checks our engine's MTP layer against, so what is fitted here is what serves.

Drafting k > 1 tokens applies the one layer recursively: step 2 reads step 1's output as its hidden state, which
teacher-forced training never shows it; `depth` 2 also trains that second application (rows fed their own step-1
outputs), weighted by `depth_weight`. Loss only on positions the engine drafts: tokens the model generated,
after the first one of a turn (the target model's own). The block starts from the model's last decoder layer and
`eh_proj` from reading the hidden state alone, so the layer starts by predicting what the model would say next.
The checkpoint written is the base with the layer at model.layers.{num_hidden_layers} and
`num_nextn_predict_layers: 1`, in the GLM-5 checkpoint's naming.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from glm5.errors import ConfigError
from safetensors.torch import load_file, save_file

IGNORE = -100


@dataclass(frozen=True, slots=True)
class Trace:
    """A context and the model's greedy continuation of it (one engine turn)."""

    context: list[int]
    generated: list[int]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class MTPFit(torch.nn.Module):
    """The trainable layer: enorm, hnorm, eh_proj and a one-layer transformers model holding the block (its
    final norm is shared_head.norm; its LM head and embeddings the base's, frozen)."""

    def __init__(self, base: Path, work: Path) -> None:
        super().__init__()
        from transformers import GlmMoeDsaForCausalLM as HF

        cfg = json.loads((base / "config.json").read_text())
        n = cfg["num_hidden_layers"]
        self.eps = float(cfg["rms_norm_eps"])
        self.hidden_size = h = int(cfg["hidden_size"])
        one = {**cfg, "num_hidden_layers": 1, "mlp_layer_types": ["sparse"], "indexer_types": ["full"],
               "layer_types": cfg["layer_types"][:1], "num_nextn_predict_layers": 0,
               "first_k_dense_replace": 0}  # fmt: skip
        tensors = load_file(base / "model.safetensors")
        embed = tensors["model.embed_tokens.weight"]
        last = f"model.layers.{n - 1}."
        if cfg["mlp_layer_types"][n - 1] != "sparse":
            raise ConfigError(f"{base}: the last decoder layer is not a MoE layer to start the MTP block from")
        state = {"model.layers.0." + k.removeprefix(last): v.clone() for k, v in tensors.items() if k.startswith(last)}
        state |= {"model.norm.weight": tensors["model.norm.weight"].clone(),
                  "lm_head.weight": tensors["lm_head.weight"], "model.embed_tokens.weight": embed}  # fmt: skip
        work.mkdir(parents=True, exist_ok=True)
        (work / "config.json").write_text(json.dumps(one))
        save_file(state, work / "model.safetensors", metadata={"format": "pt"})
        self.block = HF.from_pretrained(work, dtype=torch.float32)
        for p in (self.block.lm_head.weight, self.block.model.embed_tokens.weight):
            p.requires_grad_(False)
        self.embed = embed  # frozen, not a parameter: the base's
        self.enorm = torch.nn.Parameter(torch.ones(h))
        self.hnorm = torch.nn.Parameter(torch.ones(h))
        eh = torch.zeros(h, 2 * h)
        eh[:, :h].normal_(0, 0.02)
        eh[:, h:] = torch.eye(h)
        self.eh_proj = torch.nn.Parameter(eh)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Rows (B, T): the token after each position, that position's hidden state (B, T, H), the positions and
        the padding mask. Returns (logits (B, T, V), the layer's output after shared_head.norm (B, T, H))."""
        e = self.embed[tokens].masked_fill((positions == 0)[..., None], 0.0)  # the engine's rule at position 0
        x = torch.cat([_rms(e, self.enorm, self.eps), _rms(hidden, self.hnorm, self.eps)], dim=-1) @ self.eh_proj.T
        out = self.block.model(inputs_embeds=x, attention_mask=mask, position_ids=positions).last_hidden_state
        return self.block.lm_head(out).float(), out

    def layer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's tensors in the checkpoint's naming, at model.layers.{layer}."""
        prefix = f"model.layers.{layer}."
        state = self.block.state_dict()
        out = {prefix + k.removeprefix("model.layers.0."): v.detach().clone()
               for k, v in state.items() if k.startswith("model.layers.0.")}  # fmt: skip
        out |= {prefix + "shared_head.norm.weight": state["model.norm.weight"].detach().clone(),
                prefix + "enorm.weight": self.enorm.detach().clone(),
                prefix + "hnorm.weight": self.hnorm.detach().clone(),
                prefix + "eh_proj.weight": self.eh_proj.detach().clone()}  # fmt: skip
        return out


@dataclass(slots=True)
class _Example:
    ids: torch.Tensor  # (T,) the whole trace
    hidden: torch.Tensor  # (T, H) the frozen model's last hidden state, after its final norm
    first: int  # the first generated position


def _hidden_states(base: Path, traces: list[Trace], batch: int = 16) -> list[_Example]:
    from transformers import GlmMoeDsaForCausalLM as HF

    model = HF.from_pretrained(base, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    order = sorted(range(len(traces)), key=lambda i: len(traces[i].context) + len(traces[i].generated))
    got: dict[int, _Example] = {}
    with torch.no_grad():
        for s in range(0, len(order), batch):
            chunk = order[s : s + batch]
            seqs = [traces[i].context + traces[i].generated for i in chunk]
            width = max(map(len, seqs))
            ids = torch.tensor([x + [0] * (width - len(x)) for x in seqs])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])
            h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for j, i in enumerate(chunk):
                t = len(seqs[j])
                got[i] = _Example(ids[j, :t].clone(), h[j, :t].clone(), len(traces[i].context))
    return [got[i] for i in range(len(traces))]


def _rows(examples: list[_Example], depth: int) -> tuple[torch.Tensor, ...]:
    """Padded step-1 inputs of a batch: (next tokens, hidden states, positions, mask, labels per depth (D, B, T))."""
    width = max(len(e.ids) - 1 for e in examples)
    h = examples[0].hidden.shape[-1]
    b = len(examples)
    tokens = torch.zeros(b, width, dtype=torch.long)
    hidden = torch.zeros(b, width, h)
    mask = torch.zeros(b, width, dtype=torch.long)
    labels = torch.full((depth, b, width), IGNORE, dtype=torch.long)
    for j, e in enumerate(examples):
        t = len(e.ids) - 1  # rows 0..T-2: row p carries x[p+1] and h[p]
        tokens[j, :t] = e.ids[1:]
        hidden[j, :t] = e.hidden[:-1]
        mask[j, :t] = 1
        for d in range(1, depth + 1):
            # row p predicts x[p+1+d]; the engine drafts from the first generated token on: p >= first - 1
            lo, hi = max(e.first - 1, 0), len(e.ids) - 1 - d
            if hi > lo:
                labels[d - 1, j, lo:hi] = e.ids[lo + 1 + d : hi + 1 + d]
    positions = torch.arange(width).expand(b, width)
    return tokens, hidden, positions, mask, labels


def _losses(fit: MTPFit, rows: tuple[torch.Tensor, ...], depth: int) -> tuple[list[torch.Tensor], list[float]]:
    """Cross-entropy per depth and accuracy (argmax = label) per depth."""
    tokens, hidden, positions, mask, labels = rows
    losses: list[torch.Tensor] = []
    accuracy: list[float] = []
    for d in range(depth):
        logits, out = fit(tokens, hidden, positions, mask)
        lab = labels[d]
        losses.append(F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE))
        valid = lab != IGNORE
        accuracy.append(float((logits.argmax(-1)[valid] == lab[valid]).float().mean()) if valid.any() else 0.0)
        # the next application: row p (position p + 1) carries x[p+2] and this step's output at p
        tokens, hidden = tokens[:, 1:], out[:, :-1]
        positions, mask, labels = positions[:, 1:], mask[:, 1:] * mask[:, :-1], labels[:, :, :-1]
    return losses, accuracy


def fit(base: Path, out: Path, traces: list[Trace], steps: int, batch: int = 16, lr: float = 2e-3, depth: int = 2,
        depth_weight: float = 0.5, held_out: float = 0.05, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Trains the layer on `traces` (a `held_out` share kept for the reported accuracy) and writes `base` with it
    to `out`. Returns the stage's record (steps, losses, per-depth accuracy on the kept traces, seconds)."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ConfigError("training needs the trainer extra: pip install -e '.[trainer]'") from exc
    if steps < 1 or not traces or depth not in (1, 2, 3):
        raise ConfigError("fitting an MTP layer needs steps >= 1, traces and depth 1..3")
    cfg = json.loads((base / "config.json").read_text())
    if cfg.get("num_nextn_predict_layers"):
        raise ConfigError(f"{base} already has MTP layers")
    torch.manual_seed(seed)
    start = time.perf_counter()
    examples = _hidden_states(base, traces)
    rng = random.Random(seed)
    rng.shuffle(examples)
    kept = max(1, int(len(examples) * held_out))
    test, train = examples[:kept], examples[kept:] or examples[:kept]
    model = MTPFit(base, out.with_name(out.name + ".block"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    weights = [depth_weight**d for d in range(depth)]
    # batches of similar lengths: a tool trace is ~10x an addition's, padding one to the other wastes the step
    train.sort(key=lambda e: len(e.ids))
    chunks = [train[i : i + batch] for i in range(0, len(train), batch)]
    loss_log: list[float] = []
    model.train()
    for step in range(steps):
        rows = _rows(rng.choice(chunks), depth)
        losses, _ = _losses(model, rows, depth)
        loss = sum(w * x for w, x in zip(weights, losses, strict=True)) / sum(weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_log.append(float(losses[0].item()))
        if (step + 1) % max(1, steps // 10) == 0:
            print(f"mtp step {step + 1}/{steps}: loss {sum(loss_log[-50:]) / len(loss_log[-50:]):.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        test.sort(key=lambda e: len(e.ids))
        acc = [0.0] * depth
        for i in range(0, len(test), batch):
            part = test[i : i + batch]
            _, a = _losses(model, _rows(part, depth), depth)
            acc = [x + y * len(part) for x, y in zip(acc, a, strict=True)]
    save(base, out, model)
    shutil.rmtree(out.with_name(out.name + ".block"), ignore_errors=True)
    return {"task": "mtp", "base": str(base), "steps": steps, "batch": batch, "learning_rate": lr, "depth": depth,
            "depth_weight": depth_weight, "traces": len(traces), "seed": seed,
            "initial_loss": sum(loss_log[:10]) / len(loss_log[:10]),
            "final_loss": sum(loss_log[-50:]) / len(loss_log[-50:]),
            "held_out_traces": len(test), "held_out_accuracy_by_depth": [x / len(test) for x in acc],
            "train_seconds": time.perf_counter() - start}  # fmt: skip


def save(base: Path, out: Path, layer: MTPFit) -> None:
    """`base` with `layer` as its MTP layer, to `out` (the base's files, tensors and config otherwise)."""
    tensors = load_file(base / "model.safetensors")
    config = json.loads((base / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    layer_tensors = layer.layer_tensors(config["num_hidden_layers"])
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "version.json", "training.json"):
            shutil.copyfile(f, out / f.name)
    save_file(tensors | layer_tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
