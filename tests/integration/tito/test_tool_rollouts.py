"""Multi-turn tool-use rollouts through the TITO gateway on a real `glm5 worker`: the environment runs the model's
tool call and splices the result into the context token-in-token-out; the gateway's ledger holds exactly the
tokens the worker generated (loss mask 1) and the tool messages (mask 0); a context re-rendered through the chat
template drifts from the ledger and is refused, naming the position; and the RL loop runs `--environment tools`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from glm5.client import sampling
from glm5.model.presets import SHIPPED_MODEL
from glm5.parsing.tools import TAGS, ToolRegistry
from glm5.rl.buffer import InProcessBuffer
from glm5.tokenizer.tokenizer import Tokenizer
from glm5.v1 import common_pb2, tito_pb2, tito_pb2_grpc, worker_pb2, worker_pb2_grpc
from glm5_tito.gateway import GatewayConfig
from glm5_tito.server import start_gateway
from glm5_trainer.config import RLConfig
from glm5_trainer.environment import CALCULATOR_TOOLS, Problem, ToolUse
from glm5_trainer.loop import RLRun

from tests.helpers.procs import ADMIN_TOKEN, admin_flags, start_worker, stop

pytestmark = pytest.mark.asyncio
TOK = Tokenizer(SHIPPED_MODEL)
PROBLEM = Problem("23*7", ({"role": "user", "content": "What is 23 * 7?"},), "161", CALCULATOR_TOOLS)
PROMPT = TOK.encode(TOK.apply_chat_template(list(PROBLEM.messages), tools=list(PROBLEM.tools), enable_thinking=True))
# The first turn is constrained to a call of `multiply` with one- or two-digit arguments (the tags are special
# tokens): the demo model has not learnt to call tools yet, and this test is about the ledger, not the model.
_TAG = {t: f"<[{TOK.token_id(t)}]>" for t in TAGS}
_ARG = '{} "{{}}" {} {} NUM {}'.format(_TAG["<arg_key>"], _TAG["</arg_key>"], _TAG["<arg_value>"], _TAG["</arg_value>"])
CALL_GRAMMAR = (f'start: {_TAG["<tool_call>"]} "multiply" {_ARG.format("a")} {_ARG.format("b")} {_TAG["</tool_call>"]}'
                "\nNUM: /[1-9][0-9]?/")  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, str]]:
    flags = ("--max-model-len", "1024", "--kv-cache-bytes", "32MiB", *admin_flags(tmp_path_factory.getbasetemp()))
    proc, engine = start_worker(SHIPPED_MODEL, *flags)
    server, gw, port = await start_gateway(GatewayConfig(engines=(engine,), heartbeat_s=0.5), InProcessBuffer(),
                                           "127.0.0.1", 0)  # fmt: skip
    try:
        yield {"gateway": f"127.0.0.1:{port}", "engine": engine}
    finally:
        await server.stop(1)
        await gw.close()
        stop(proc)


class Turns:
    """The environment's `generate` over the gateway: one Turn per call, recording what was streamed."""

    def __init__(self, gateway: tito_pb2_grpc.TitoGatewayStub, rollout_id: str) -> None:
        self.gateway, self.rollout_id = gateway, rollout_id
        self.contexts: list[list[int]] = []
        self.streamed: list[tuple[list[int], list[float]]] = []

    async def __call__(self, context: list[int]) -> tuple[list[int], bool]:
        first = not self.contexts
        fmt = common_pb2.StructuredOutput(lark_grammar=CALL_GRAMMAR) if first else None
        params = sampling(temperature=0.0, max_new_tokens=48, structured_output=fmt)
        request = tito_pb2.TurnRequest(rollout_id=self.rollout_id, group_id="tools", context_token_ids=context,
                                       sampling=params)  # fmt: skip
        self.contexts.append(list(context))
        ids: list[int] = []
        lps: list[float] = []
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        async for r in self.gateway.Turn(request, timeout=120):
            ids += r.token_ids
            lps += r.logprobs
            finish = r.finish_reason or finish
        self.streamed.append((ids, lps))
        return ids, finish == common_pb2.FINISH_REASON_LENGTH


@pytest.mark.asyncio(loop_scope="module")
async def test_the_ledger_holds_the_workers_tokens_and_masks_the_tool_result(stack: dict[str, str]) -> None:
    async with grpc.aio.insecure_channel(stack["gateway"]) as ch:
        gateway = tito_pb2_grpc.TitoGatewayStub(ch)
        turns = Turns(gateway, "tools/ledger")
        outcome = await ToolUse(max_turns=2).play(PROBLEM, PROMPT, turns, TOK)
        record = await gateway.FinishRollout(tito_pb2.FinishRolloutRequest(
            rollout_id="tools/ledger", reward=outcome.reward, status=tito_pb2.ROLLOUT_STATUS_COMPLETED))  # fmt: skip
    assert outcome.calls == 1 and outcome.turns == 2 and len(record.turn_versions) == 2
    (gen1, lps1), (gen2, lps2) = turns.streamed
    call = TOK.decode(gen1)
    assert call.startswith("<tool_call>multiply<arg_key>a</arg_key><arg_value>") and call.endswith("</tool_call>")
    args = ToolRegistry.from_openai(list(CALCULATOR_TOOLS)).resolve(
        call.removeprefix("<tool_call>").removesuffix("</tool_call>")
    )
    product = args.arguments["a"] * args.arguments["b"]  # type: ignore[union-attr]
    spliced = turns.contexts[1][len(PROMPT) + len(gen1) :]
    assert TOK.decode(spliced) == f"<|observation|>\n<tool_response>{product}</tool_response><|assistant|>\n"
    # token for token: prompt (mask 0), the worker's call (1), the tool message (0), the worker's answer (1)
    assert list(record.token_ids) == PROMPT + gen1 + spliced + gen2 == turns.contexts[1] + gen2
    assert list(record.loss_mask) == [0] * len(PROMPT) + [1] * len(gen1) + [0] * len(spliced) + [1] * len(gen2)
    assert list(record.logprobs) == pytest.approx([0.0] * len(PROMPT) + lps1 + [0.0] * len(spliced) + lps2, abs=1e-6)
    assert record.prompt_tokens == len(PROMPT)
    # and the second turn is what the worker generates for that context on its own (greedy)
    async with grpc.aio.insecure_channel(stack["engine"]) as wch:
        direct = [t async for r in worker_pb2_grpc.WorkerStub(wch).Generate(worker_pb2.GenerateRequest(
            prompt_token_ids=turns.contexts[1], sampling=sampling(temperature=0.0, max_new_tokens=48)))
            for t in r.token_ids]  # fmt: skip
    assert direct == gen2


@pytest.mark.asyncio(loop_scope="module")
async def test_a_re_rendered_context_drifts_from_the_ledger_and_is_refused(stack: dict[str, str]) -> None:
    async with grpc.aio.insecure_channel(stack["gateway"]) as ch:
        gateway = tito_pb2_grpc.TitoGatewayStub(ch)
        turns = Turns(gateway, "tools/drift")
        await turns(PROMPT)
        (gen1, _), rid = turns.streamed[0], "tools/drift"
        ledger = list((await gateway.GetRollout(tito_pb2.GetRolloutRequest(rollout_id=rid))).token_ids)
        assert ledger == PROMPT + gen1
        # An agent that keeps messages, not tokens, renders the conversation again and re-tokenises it: the
        # template writes the assistant turn its own way (an empty <think></think>, the arguments re-encoded).
        call = ToolRegistry.from_openai(list(CALCULATOR_TOOLS)).resolve(
            TOK.decode(gen1)[len("<tool_call>") : -len("</tool_call>")]
        )
        messages = [*PROBLEM.messages,
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "multiply",
                                                                                      "arguments": call.arguments}}]},  # type: ignore[union-attr]
                    {"role": "tool", "content": "0"}]  # fmt: skip
        rendered = TOK.encode(TOK.apply_chat_template(messages, tools=list(PROBLEM.tools), enable_thinking=True))
        at = next(i for i, (a, b) in enumerate(zip(rendered, ledger, strict=False)) if a != b)
        assert at >= len(PROMPT)  # the prompt itself renders the same; the generated turn does not
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await turns(rendered)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"first difference at position {at}" in (err.value.details() or "")
        # nothing was half-applied: the ledger is unchanged and the exact splice still continues the rollout
        assert list((await gateway.GetRollout(tito_pb2.GetRolloutRequest(rollout_id=rid))).token_ids) == ledger
        await turns(ledger + TOK.encode("<|observation|>\n<tool_response>0</tool_response><|assistant|>\n"))
        record = await gateway.FinishRollout(tito_pb2.FinishRolloutRequest(
            rollout_id=rid, reward=0.0, status=tito_pb2.ROLLOUT_STATUS_COMPLETED))  # fmt: skip
    assert len(record.turn_versions) == 2 and sum(record.loss_mask) == len(gen1) + len(turns.streamed[-1][0])


@pytest.mark.asyncio(loop_scope="module")
async def test_the_rl_loop_runs_the_tool_environment(stack: dict[str, str], tmp_path: Path) -> None:
    config = RLConfig(policy=SHIPPED_MODEL, gateway=stack["gateway"], out=tmp_path, engines=(stack["engine"],),
                      environment="tools", mode="sync", steps=1, group_size=2, groups_per_step=2, eval_size=4,
                      max_new_tokens=24, learning_rate=1e-4, progress=False, admin_token=ADMIN_TOKEN)  # fmt: skip
    result = await RLRun(config).run()
    assert result.final_version == 1 and len(result.history) == 1
    assert result.evaluation_before is not None and result.evaluation_before["problems"] == 4
    assert result.evaluation_after is not None and 0.0 <= result.evaluation_after["accuracy"] <= 1.0
    assert result.counters.get("rollouts_failed", 0) == 0
    assert (tmp_path / "rl.png").stat().st_size > 0
