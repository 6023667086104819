"""Supervised tool use for the demo model: synthetic calculator traces in GLM-5's tool-call format, fine-tuned
on top of an addition checkpoint with addition replayed (so it keeps answering plain questions with thinking).

A trace is the multi-turn episode the `tools` environment plays, tokenised exactly as the environment and the
TITO gateway build it (each turn's text encoded on its own, the tool message spliced in between):

    prompt (tools in the system turn; no loss)
    <think>23 * 7: multiply</think><tool_call>multiply<arg_key>a</arg_key><arg_value>23</arg_value>...
        </tool_call><|observation|>                                                     (loss)
    \\n<tool_response>161</tool_response><|assistant|>\\n                               (no loss: the tool's)
    <think></think>The answer is **161**.<|endoftext|>                                  (loss)

The answer copies the tool's result token for token: the byte-level BPE splits a number by what precedes it
("161" after a special token or "**" is 1|61, " 161" after a space is " 1"|61, "2244" is 22|44 but " 2244" is
" 2"|24|4), so "The answer is 161." would ask the model to re-split the digits, which it had not learnt after
1,300 steps (the digits' loss stayed at ~5 nats, uniform over the numbers), while bold keeps the split.

Copying from the tool message is the one new attention pattern a trace teaches, and over a trace's ~550 tokens
(most of them the tools' JSON) its gradient is weak: `drill_share` of the tool steps are drills, the same turns
after the question asked without tools (~60 tokens, the loss on the answer only), 48 to a batch.

Steps alternate between batches of traces and batches of additions (one kind per batch: a trace is ~20x longer
than an addition, and padding one to the other would waste the step). Single-digit sums are over-sampled: they
are 1% of the addition pairs and the first thing a person asks. A share of the additions answer in JSON after
their thinking (`<think>12 + 30 = 42</think>{"answer": 42}`): nothing in the prompt asks for it (as with
`response_format`, which adds nothing to the prompt), so greedy text stays "The answer is 42."; when a JSON
Schema forces `{"answer": ` the model has learnt what follows, the number and the closing brace.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from glm5.errors import ConfigError
from glm5.tokenizer.build import TOOL_RENDERINGS, chat_template
from glm5.tokenizer.tokenizer import Tokenizer

from glm5_trainer.environment import CALCULATOR_TOOLS, OBSERVATION, Problem, prompt_ids, tool_problems
from glm5_trainer.sft import encode as addition_example
from glm5_trainer.sft import split_pairs, train_step
from glm5_trainer.tool_family import OPERATION_OF, calculation, held_out_pair, sample

TOOL_OF = {"*": "multiply", "+": "add"}


def tool_turns(p: Problem) -> tuple[str, str, str]:
    """(the model's call turn, the tool message the environment splices in, the model's answer turn). The call
    goes to the offered tool that computes the question's operation, its arguments in the order the tool's schema
    lists its parameters; with thinking off (`p.thinking`) the prompt ends in an empty thinking block and the
    turn is the call alone."""
    a, op, b = calculation(p)
    fn = (
        next(t["function"] for t in p.tools if OPERATION_OF.get(t["function"]["name"]) == op)
        if p.tools
        else {"name": TOOL_OF[op], "parameters": CALCULATOR_TOOLS[0]["function"]["parameters"]}
    )  # a drill's problem
    first, second = fn["parameters"]["properties"]
    think = f"<think>{a} {op} {b}: {fn['name']}</think>" if p.thinking else ""
    call = (f"{think}<tool_call>{fn['name']}<arg_key>{first}</arg_key><arg_value>{a}</arg_value>"
            f"<arg_key>{second}</arg_key><arg_value>{b}</arg_value></tool_call>{OBSERVATION}")  # fmt: skip
    result = f"\n<tool_response>{p.answer}</tool_response><|assistant|>\n"
    answer = f"<think></think>The answer is **{p.answer}**."
    if not p.thinking:  # the chat template opens the answer turn with the empty thinking block, as the prompt
        result, answer = result + "<think></think>", answer.removeprefix("<think></think>")
    return call, result, answer


def _op_first(c: tuple[int, str, int]) -> tuple[str, int, int]:
    return c[1], c[0], c[2]


def _episode(tok: Tokenizer, p: Problem, prompt: list[int], call_loss: bool) -> tuple[list[int], list[int]]:
    call, result, answer = (tok.encode(t) for t in tool_turns(p))
    answer = [*answer, tok.eos_token_ids()[0]]
    ids = prompt + call + result + answer
    labels = [-100] * len(prompt) + (call if call_loss else [-100] * len(call)) + [-100] * len(result) + answer
    return ids, labels


def trace(tok: Tokenizer, p: Problem) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one episode: the loss covers the model's two turns (and its end token) only."""
    return _episode(tok, p, prompt_ids(tok, p), call_loss=True)


def drill(tok: Tokenizer, p: Problem) -> tuple[list[int], list[int]]:
    """The episode's turns after the question asked without tools (the module docstring says why), the loss on
    the answer only: the call is not taught where no tools were offered."""
    return _episode(tok, p, prompt_ids(tok, dataclasses.replace(p, tools=())), call_loss=False)


def json_answer(tok: Tokenizer, a: int, b: int) -> tuple[list[int], list[int]]:
    """An addition answered as {"answer": N} (compact JSON, as the worker's JSON formats emit it)."""
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                                enable_thinking=True))  # fmt: skip
    answer = [*tok.encode(f'<think>{a} + {b} = {a + b}</think>{{"answer": {a + b}}}'), tok.eos_token_ids()[0]]
    return prompt + answer, [-100] * len(prompt) + answer


def _save(model: torch.nn.Module, tokenizer: Path, out: Path) -> None:
    model.eval()
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    if tokenizer != out:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_bytes((tokenizer / name).read_bytes())


def _tokenizer_with(base: Path, out: Path, tool_rendering: str) -> Path:
    """The base's tokenizer written to `out`, its chat template writing tools as `tool_rendering`."""
    if tool_rendering not in TOOL_RENDERINGS:
        raise ConfigError(f"tool_rendering: {tool_rendering!r} is not one of {', '.join(TOOL_RENDERINGS)}")
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = chat_template(tool_rendering)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    return out


def finetune(base: Path, out: Path, steps: int, tool_batch: int = 8, addition_batch: int = 48, lr: float = 1e-3,
             tool_share: float = 0.5, small_share: float = 0.25, json_share: float = 0.15, held_out: int = 500,
             drill_share: float = 0.0, index_topk: int | None = 1024, variant_share: float = 0.0,
             thinking_off_share: float = 0.0, checkpoint_every: int = 0, tool_rendering: str | None = None,
             made_up_params: float = 0.0, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Fine-tunes the checkpoint `base` (the addition model, with its tokenizer) into `out`; returns what
    training.json records. `tool_share`: the share of steps on traces; `small_share`: the share of an addition
    batch drawn from single-digit sums; `json_share`: the share answered in JSON; `drill_share`: the share of the
    tool steps that are answer drills (`drill`); `variant_share`: the share of the tool steps' problems drawn from
    tool_family's training problems (varied tool definitions, phrasings, operands of 1-4 digits) instead of the
    training format's (environment.tool_problems), and then none of tool_family's held-out operand pairs;
    `thinking_off_share`: the share of those asked with thinking off; `checkpoint_every` (0: never): also save
    the model every so many steps, to `out/checkpoints/stepN`; `tool_rendering` (None: the base's template):
    the chat template's way of writing the offered tools (glm5.tokenizer.build.TOOL_RENDERINGS), trained with
    and written into `out`'s tokenizer_config.json; `made_up_params`: the share of those problems whose
    parameters have made-up names (tool_family.random_params), so that the calls copy names from the schema.

    `index_topk` (None: the base's) replaces the checkpoint's: a trace is ~550 tokens, past the tiny preset's
    top-k of 256, and transformers' indexer runs without gradients (DSA trains it apart, by distillation from
    dense attention), so the untrained indexer of the addition model (whose sequences never reached 256) would
    pick which half of the context each token sees. 1,024 keeps the demo's contexts dense (measured: tool loss
    1.09 vs 1.49 at step 200, same seed)."""
    try:
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    except ImportError as exc:
        raise ConfigError("training needs the trainer extra: pip install -e '.[trainer]'") from exc

    torch.manual_seed(seed)
    tokenizer = _tokenizer_with(base, out, tool_rendering) if tool_rendering else base
    tok = Tokenizer(tokenizer)
    config = GlmMoeDsaConfig.from_pretrained(base)
    if index_topk is not None:  # on the config object: a keyword would land in generation_config.json too
        config.index_topk = index_topk
    model = GlmMoeDsaForCausalLM.from_pretrained(base, config=config, dtype=torch.float32)
    model.train()
    tools_train, tools_held_out = tool_problems(held_out=held_out, seed=seed)
    if variant_share > 0:  # tool_family's held-out pairs are never trained on
        tools_train = [p for p in tools_train if not held_out_pair(*_op_first(calculation(p)))]
    exclude = frozenset(p.id for p in tools_held_out)
    pairs, _ = split_pairs(99, held_out, seed)
    small = [(a, b) for a, b in pairs if a < 10 and b < 10]
    rng = random.Random(seed)

    def tool_batch_of(n: int) -> list[Problem]:
        if not variant_share:  # the training format only, drawn as before
            return rng.sample(tools_train, n)
        thinking = [rng.random() >= thinking_off_share for _ in range(n)]
        return [rng.choice(tools_train) if rng.random() >= variant_share else
                sample(rng, thinking=t, exclude=exclude, made_up_params=made_up_params) for t in thinking]  # fmt: skip

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    start, losses = time.perf_counter(), {"tools": [0.0], "drill": [0.0], "addition": [0.0]}
    for step in range(steps):
        if rng.random() < tool_share:
            if rng.random() < drill_share:
                kind, items = "drill", [drill(tok, p) for p in tool_batch_of(addition_batch)]
            else:
                kind, items = "tools", [trace(tok, p) for p in tool_batch_of(tool_batch)]
        else:
            n_small = round(addition_batch * small_share)
            chosen = rng.sample(small, min(n_small, len(small))) + rng.sample(pairs, addition_batch - n_small)
            rng.shuffle(chosen)
            n_json = round(addition_batch * json_share)
            kind = "addition"
            items = [json_answer(tok, a, b) for a, b in chosen[:n_json]]
            items += [addition_example(tok, a, b) for a, b in chosen[n_json:]]
        losses[kind].append(train_step(model, opt, sched, items))
        if step % 50 == 0 or step == steps - 1:
            recent = {k: sum(v[-25:]) / len(v[-25:]) for k, v in losses.items()}
            shown = "  ".join(f"{k} {v:.4f}" for k, v in recent.items())
            print(f"step {step:5d}  loss {shown}  {time.perf_counter() - start:6.0f}s", flush=True)
        if checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            _save(model, tokenizer, out / "checkpoints" / f"step{step + 1}")
            model.train()
    _save(model, tokenizer, out)
    final = {k: sum(v[-25:]) / len(v[-25:]) for k, v in losses.items()}
    return {"task": "tools", "base": str(base), "steps": steps, "tool_batch": tool_batch,
            "addition_batch": addition_batch, "learning_rate": lr, "tool_share": tool_share,
            "small_share": small_share, "json_share": json_share, "drill_share": drill_share, "held_out": held_out,
            "index_topk": model.config.index_topk, "variant_share": variant_share,
            "thinking_off_share": thinking_off_share, "tool_rendering": tool_rendering,
            "made_up_params": made_up_params, "seed": seed,
            "final_loss": final, "train_seconds": time.perf_counter() - start}  # fmt: skip
