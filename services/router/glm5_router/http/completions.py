"""POST /v1/completions: one or more prompts (text or token ids) x `n` choices, each a request of its own; the
text as the model wrote it (reasoning inside its tags), `echo`, logprobs with text offsets."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from glm5.v1 import common_pb2, worker_pb2

from glm5_router.frontend import Delta
from glm5_router.http import params as fields
from glm5_router.http.errors import ApiError
from glm5_router.http.formatting import FINISH, TextChoice, completion_logprobs
from glm5_router.http.intake import Intake
from glm5_router.http.streaming import respond


class Completions:
    def __init__(self, intake: Intake) -> None:
        self.intake, self.frontend = intake, intake.frontend

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await self.intake.body(request)
        base = fields.sampling(body, self.intake.limits)
        n = fields.choices(body)
        logprobs = fields.logprobs_count(body, "logprobs")
        if logprobs is not None:
            base.return_logprobs, base.top_logprobs = True, logprobs
        echo = fields.get(body, "echo", bool, False)
        base.return_prompt_logprobs = echo and base.return_logprobs
        inp = self.intake.input(request, body, base)
        prompts = fields.prompts(body.get("prompt"))
        if len(prompts) * n > fields.MAX_CHOICES:  # `n` x prompts, each a request of its own
            raise ApiError(400, f"prompt: {len(prompts)} prompts x n={n} choices is more than {fields.MAX_CHOICES}",
                           "invalid_request_error", "prompt")  # fmt: skip
        inputs = []
        for k, prompt in enumerate(prompts):
            one = dataclasses.replace(inp, request_id=f"{inp.request_id}-p{k}" if len(prompts) > 1 else inp.request_id)
            if isinstance(prompt, str):
                one.prompt = prompt
            else:
                one.prompt_token_ids = prompt
            inputs += self.intake.fan_out(one, n)
        built = [await self.frontend.build_async(x) for x in inputs]  # choice = prompt index * n + choice, as OpenAI's
        streams = [self.frontend.stream(job, in_reasoning, None, inp.session_id) for job, in_reasoning, _ in built]
        tok = self.frontend.tokenizer
        choices = []
        for i, ((job, in_reasoning, _), one) in enumerate(zip(built, inputs, strict=True)):
            ids = list(job.request.prompt_token_ids)
            choices.append(TextChoice(i, in_reasoning, (one.prompt or tok.decode(ids)) if echo else "", ids))

        def choice_json(c: TextChoice, text: str, finish: str | None,
                        resp: worker_pb2.GenerateResponse) -> dict[str, Any]:  # fmt: skip
            out: dict[str, Any] = {"index": c.index, "text": text, "finish_reason": finish, "logprobs": None}
            if base.return_logprobs:
                lps: list[common_pb2.TokenLogprob | None] = list(resp.logprobs)
                ids = [lp.token_id for lp in resp.logprobs]
                if base.return_prompt_logprobs and resp.prompt_logprobs:  # the echoed prompt comes first
                    lps, ids = [None, *resp.prompt_logprobs, *lps], c.prompt_ids + ids
                out["logprobs"] = completion_logprobs(tok, lps, ids, c.offset)
            c.offset += len(text)
            return out

        def chunk(i: int, d: Delta) -> dict[str, Any] | None:
            finish = FINISH.get(d.response.finish_reason)
            text = choices[i].text(d)
            return choice_json(choices[i], text, finish, d.response) if text or finish else None

        async def collect(i: int, stream: AsyncIterator[Delta]) -> tuple[dict[str, Any], worker_pb2.GenerateResponse]:
            parts, merged, last = [], worker_pb2.GenerateResponse(), None
            async for d in stream:
                parts.append(choices[i].text(d))
                merged.logprobs.extend(d.response.logprobs)
                if d.response.prompt_logprobs and not merged.prompt_logprobs:
                    merged.prompt_logprobs.extend(d.response.prompt_logprobs)
                last = d.response
            assert last is not None
            return choice_json(choices[i], "".join(parts), FINISH.get(last.finish_reason), merged), last

        cid, objects = f"cmpl-{uuid.uuid4().hex}", ("text_completion", "text_completion")
        return await respond(request, inp.request_id, body, streams, n, cid, self.frontend.model_name, objects, chunk,
                             collect)  # fmt: skip
