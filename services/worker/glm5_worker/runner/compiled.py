"""Decode steps as compiled graphs (torch.compile, inductor's C++/OpenMP code on the CPU).

A small decode batch is dispatch-bound: one eager step of the tiny model dispatches ~2,500 ATen ops whose
arithmetic is a fraction of their overhead. Compiled, the same step is a few fused loops around the matrix
products. vLLM captures its decode steps per batch size (CUDA graphs); on the CPU inductor's code takes symbolic
sizes, so a handful of graphs covers every step:

- batch 1, and batches 2..compile_max_batch (the batch size symbolic);
- contexts up to top-k tokens (every token picked, no indexer scoring) and longer ones (the block-table width
  symbolic: the context is padded to whole blocks and masked by the context lengths).

A serving worker compiles them on a thread of its own while its engine thread steps eagerly, and the engine takes
them all at once when the last one is built (Engine.compile_in_background); Engine built directly (tests,
benchmarks) compiles them before it returns. Compiling is reported and bounded by compile_budget_s, and kept on
disk by inductor's caches between starts; nothing is compiled afterwards: a step that would need a new graph
(dynamic sparsity changed a layer's top-k, say) runs eagerly instead. Prefill chunks, contexts long enough for
in-place index scoring and larger batches stay eager too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from glm5.model.batch import DecodeGroup, ForwardBatch

if TYPE_CHECKING:
    from glm5_worker.runner.model_runner import ModelRunner
    from glm5_worker.runner.plan import StepPlan

log = logging.getLogger(__name__)
_MIN_WIDTH = 2  # block tables are padded to at least this many blocks: a size of 1 would get its own graph


def default_cache_dir() -> Path:
    env = os.environ.get("GLM5_COMPILE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "glm5" / "compile"


def unavailable(runner: ModelRunner) -> str | None:
    """Why this runner's decode steps cannot be compiled (None: they can)."""
    if runner.device.type != "cpu":
        return f"compiled decode steps are checked on the CPU only so far, not on {runner.device.type}"
    if runner.tp.size > 1:
        return "compiled decode steps run on one device only (this replica spans several)"
    if runner.kernels.name != "portable":
        return f"compiled decode steps use the portable kernels, not {runner.kernels.name}"
    if any(not p.is_floating_point() or p.element_size() == 1 for p in runner.model.parameters()):
        return "compiled decode steps need float weights (this checkpoint is quantized)"
    if runner.controls.dense_warmup_tokens > runner.model.config.index_topk:
        return "compiled decode steps need --dense-warmup-tokens <= the model's index_topk"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "inductor needs a C++ compiler (g++, or $CXX) for compiled decode steps and none is installed"
    return None


@dataclass(frozen=True, slots=True)
class Shape:
    """One compiled graph: a single sequence or a batch, contexts up to top-k or longer."""

    single: bool
    long: bool

    def __str__(self) -> str:
        return f"{'batch 1' if self.single else 'batch 2+'}, {'long' if self.long else 'short'} contexts"


# most useful first (one user, a long context): the order warm_up compiles them in
SHAPES = (Shape(True, True), Shape(True, False), Shape(False, True), Shape(False, False))

# Inductor options of every graph:
# - a C++ wrapper calls the step's kernels and matrix products instead of Python: 25-35% off a batch-1 step of
#   the tiny model (docs/benchmarks.md n);
# - in the batch-1 graphs, matrix-vector products (one row, both weight dimensions <= 2048) become loops
#   inductor generates and fuses with their neighbours instead of calls into the BLAS library: ~20% off a
#   batch-1 step of the tiny model; larger weights (a real model's) keep the library's products;
# - memory planning: the graph's temporaries come from one pool allocated per call, not one allocation each
#   (~5% off the tiny model's batch-1 step, 6 of 6 interleaved runs).
_OPTIONS: dict[str, Any] = {
    "cpp_wrapper": True,
    "memory_planning": True,
    "post_grad_fusion_options": {"decompose_mm_pass": {}},
}


def _compile(method: types.MethodType, shape: Shape, kind: str = "decode") -> Callable[..., tuple[torch.Tensor, ...]]:
    """`method` compiled for one shape. Each shape's function has its own copy of the code object: dynamo
    keeps its graphs per code object and checks each one's guards in turn until one passes, ~17 us each on
    the tiny model, so a single cache of four graphs cost a batch-1 step ~70 us of guard checks."""
    fn = method.__func__
    name = f"{kind}_{'single' if shape.single else 'batch'}_{'long' if shape.long else 'short'}"
    code = fn.__code__.replace(co_name=name, co_qualname=f"CompiledDecode.{name}")
    clone = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    return torch.compile(types.MethodType(clone, method.__self__), options=_OPTIONS)


class CompiledDecode:
    def __init__(self, runner: ModelRunner, max_batch: int, cache_dir: Path, budget_s: float) -> None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # inductor's caches (generated code, compiled graphs) live here; it reads the variable when it compiles
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir.resolve())
        self.runner = runner
        self.max_batch = max_batch
        self.cache_dir = cache_dir
        self.budget_s = budget_s
        cfg = runner.model.config
        self.block_size = runner.rc.cache.block_size
        self.paged_min = runner.controls.paged_scoring_min_tokens
        # the graph branches on `context > top-k`: both sides are compiled
        self.long_width = max(_MIN_WIDTH, cfg.index_topk // self.block_size + 1)
        self.short_width = _MIN_WIDTH if _MIN_WIDTH * self.block_size <= cfg.index_topk else None
        self.ready: set[Shape] = set()
        # layers whose attention entropy a decode step measures: those with attention over a pick (all of them)
        self.entropy_layers = list(range(cfg.num_hidden_layers))
        self.compile_seconds = 0.0
        self.cache_hits = 0  # graphs warm_up found in inductor's cache
        self.steps = 0  # decode steps run compiled
        self.draft_steps = 0  # MTP passes run compiled
        self.fallbacks = 0  # decode steps that needed a graph not compiled at start-up
        self._fns = {shape: _compile(self._decode, shape) for shape in SHAPES}  # type: ignore[arg-type]
        # MTP speculative decoding: the MTP layer's decode passes (the verified positions, the recursive drafts)
        self.draft_ready: set[Shape] = set()
        self._draft_fns = {shape: _compile(self._draft, shape, "draft") for shape in SHAPES  # type: ignore[arg-type]
                           if runner.model.mtp_layers}  # fmt: skip

    def _decode(self, rows: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits, each sparse layer's attention entropy, and the last hidden states (an MTP pass drafts from
        them). The entropy is measured every step (a few hundred products at these batch sizes), so the steps the
        engine samples it on need no graph of their own. `rows` holds the token ids, positions, KV slots and
        context lengths (one tensor: building a tensor costs microseconds)."""
        r = self.runner
        assert r.storage is not None
        input_ids, positions, slots, lengths = rows.unbind(0)
        group = DecodeGroup(input_ids.shape[0], tables, lengths, tables.shape[1] * self.block_size)
        batch = ForwardBatch(input_ids, positions, slots, group, [], input_ids, collect_entropy=True)
        hidden = r.model.hidden_states(batch, r.storage, r.kernels, r.controls)
        logits = r.model.logits(hidden)
        return logits, torch.stack([batch.entropy[layer] for layer in self.entropy_layers]), hidden

    def _draft(self, rows: torch.Tensor, tables: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The first MTP layer over decode rows (ModelRunner.draft): every row's logits and output."""
        r = self.runner
        assert r.storage is not None
        input_ids, positions, slots, lengths = rows.unbind(0)
        group = DecodeGroup(input_ids.shape[0], tables, lengths, tables.shape[1] * self.block_size)
        batch = ForwardBatch(input_ids, positions, slots, group, [], input_ids)
        return r.model.mtp_forward(batch, hidden, r.storage, r.kernels, r.controls, 0, all_logits=True)

    def _shape(self, batch: int, width: int) -> Shape:
        return Shape(single=batch == 1, long=width * self.block_size > self.runner.model.config.index_topk)

    @staticmethod
    def _width(tables: list[list[int]]) -> int:
        return max(_MIN_WIDTH, *(len(t) for t in tables))

    def _inputs(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        rows = torch.tensor([ids, positions, slots, lengths], dtype=torch.long)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        # the batch size is symbolic in the batch graphs, the table width in all of them
        if len(ids) > 1:
            torch._dynamo.maybe_mark_dynamic(rows, 1)
            torch._dynamo.maybe_mark_dynamic(table, 0)
        torch._dynamo.maybe_mark_dynamic(table, 1)
        return rows, table

    # start-up ------------------------------------------------------------------------------------------------
    def shapes(self) -> list[Shape]:
        """The shapes warm_up compiles, most useful first (one user, a long context)."""
        return [s for s in SHAPES if (self.long_width if s.long else self.short_width) is not None
                and (s.single or self.max_batch >= 2)]  # fmt: skip

    def _key(self) -> str:
        """What inductor's cache keys depend on, roughly (the code itself aside): a start that finds its key in
        the record below expects cached graphs. The KV pool's sizes are in it: graphs over another pool size
        are compiled again."""
        r = self.runner
        assert r.storage is not None
        pools = [(tuple(t.shape), str(t.dtype)) for t in vars(r.storage).values() if isinstance(t, torch.Tensor)]
        parts = (torch.__version__, repr(r.model.config), str(r.rc.dtype), self.block_size, self.max_batch, pools,
                 repr(_OPTIONS), [str(s) for s in self.shapes()], bool(self._draft_fns))  # fmt: skip
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]

    @property
    def _record(self) -> Path:
        return self.cache_dir / "glm5-compiles.json"

    def _recorded(self) -> dict[str, float]:
        try:
            data = json.loads(self._record.read_text())
        except (OSError, ValueError):
            return {}
        return {k: float(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def expectation(self) -> str:
        """What the coming compile should cost, for the log line that announces it."""
        seconds = self._recorded().get(self._key())
        if seconds is not None:
            return f"cached: the last start took {seconds:.0f} s"
        return "not cached yet: a few minutes (2-4 on a 2-core CPU), then cached"

    def warm_up(self, scratch_block: int = 0) -> None:
        """Compiles every shape, most useful first, while the budget lasts. Writes the KV of dummy tokens into
        `scratch_block`'s first slots and reads only that block: a block no sequence holds meanwhile (block 0
        before anything is cached; Engine.compile_in_background reserves one while the engine serves)."""
        shapes = self.shapes()
        log.info("compiling decode steps: %d graphs (batches of 1%s; short and long contexts) with inductor, cache "
                 "%s: %s", len(shapes), f" and 2-{self.max_batch}" if self.max_batch > 1 else "", self.cache_dir,
                 self.expectation())  # fmt: skip
        start = time.perf_counter()
        inductor = torch._dynamo.utils.counters["inductor"]
        hits0 = inductor["fxgraph_cache_hit"]
        for shape in shapes:
            width = self.long_width if shape.long else self.short_width
            assert width is not None
            if time.perf_counter() - start > self.budget_s:
                log.warning("compile budget of %.0f s spent: %s run eagerly", self.budget_s, shape)
                continue
            b = 1 if shape.single else 2
            t0 = time.perf_counter()
            first = scratch_block * self.block_size
            args = self._inputs([0] * b, [width * self.block_size - 1] * b, list(range(first, first + b)),
                                [[scratch_block] * width] * b, [width * self.block_size] * b, width)  # fmt: skip
            try:
                with torch.inference_mode():
                    self._fns[shape](*args)
            except Exception as exc:  # a compiler that fails here must not stop the worker: it serves eagerly
                log.warning("compiling decode steps (%s) failed, they run eagerly: %s", shape, exc)
                continue
            self.ready.add(shape)
            if shape in self._draft_fns:
                hidden = torch.zeros(b, self.runner.model.config.hidden_size, dtype=self.runner.rc.dtype)
                if b > 1:
                    torch._dynamo.maybe_mark_dynamic(hidden, 0)
                try:
                    with torch.inference_mode():
                        self._draft_fns[shape](*args, hidden)
                    self.draft_ready.add(shape)
                except Exception as exc:
                    log.warning("compiling MTP draft steps (%s) failed, they run eagerly: %s", shape, exc)
            log.info("compiled decode steps (%s) in %.1f s", shape, time.perf_counter() - t0)
        self.compile_seconds = time.perf_counter() - start
        self.cache_hits = inductor["fxgraph_cache_hit"] - hits0
        if self._draft_fns and self.draft_ready != self.ready:
            return  # a draft graph failed: the next start compiles again (and says so)
        log.info("decode steps compiled in %.1f s, %d of %d graphs from the cache %s (--enforce-eager skips this)",
                 self.compile_seconds, self.cache_hits, len(self.ready), self.cache_dir)  # fmt: skip
        if self.ready == set(shapes):
            self._remember()

    def _remember(self) -> None:
        record = self._recorded()
        record[self._key()] = round(self.compile_seconds, 1)
        with contextlib.suppress(OSError):  # only the next start's expectation depends on it
            tmp = self._record.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
            tmp.replace(self._record)

    # steps ---------------------------------------------------------------------------------------------------
    def _call(self, fns: dict[Shape, Callable[..., tuple[torch.Tensor, ...]]], ready: set[Shape], plan: StepPlan,
              *extra: torch.Tensor) -> tuple[torch.Tensor, ...] | None:  # fmt: skip
        """`plan` through its shape's graph in `fns`; None when it must run eagerly."""
        b = len(plan.decode_tables)
        if plan.prefills or not 1 <= b <= self.max_batch or plan.layer_topk is not None:
            return None
        width = self._width(plan.decode_tables)
        shape = self._shape(b, width)
        # longer contexts score their indexer keys in place, eagerly
        if width * self.block_size >= self.paged_min or shape not in ready:
            return None
        args = self._inputs(plan.input_ids, plan.positions, plan.slots, plan.decode_tables, plan.decode_lengths,
                            width)  # fmt: skip
        if extra and b > 1:
            for t in extra:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            # never compile while serving: a step that needs a new graph runs eagerly
            with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):
                return fns[shape](*args, *extra)
        except (torch._dynamo.exc.RecompileError, RuntimeError) as exc:
            # a frame after a graph break that would recompile raises a plain RuntimeError; the eager rerun
            # writes the same KV rows again, so a step cut short there is safe to repeat
            if not isinstance(exc, torch._dynamo.exc.RecompileError) and "fail_on_recompile" not in str(exc):
                raise
            self.fallbacks += 1
            if self.fallbacks == 1:
                log.info("a decode step needs a graph not compiled at start-up; it runs eagerly (%s)", exc)
            return None

    def run_draft(self, plan: StepPlan, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An MTP pass of decode rows through its compiled graph: every row's logits and output; None when it
        must run eagerly."""
        done = self._call(self._draft_fns, self.draft_ready, plan, hidden)
        if done is None:
            return None
        self.draft_steps += 1
        logits, out = done
        return logits, out

    def run(self, plan: StepPlan) -> tuple[torch.Tensor, dict[int, float], torch.Tensor] | None:
        """Logits of a decode-only step through its compiled graph, the attention entropy per layer when the
        plan asks for it, and the rows' last hidden states; None when the step must run eagerly."""
        done = self._call(self._fns, self.ready, plan)
        if done is None:
            return None
        logits, entropy, hidden = done
        self.steps += 1
        if not plan.collect_entropy:
            return logits, {}, hidden
        return logits, dict(zip(self.entropy_layers, entropy.tolist(), strict=True)), hidden
