"""Request validation: every rule names the field it checks, so the API can say exactly what is wrong."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from glm5.errors import InvalidRequestError, check_vocabulary

from glm5_worker.engine.sequence import SamplingParams

log = logging.getLogger(__name__)
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_PENALTY = 2.0  # presence / frequency penalties, as OpenAI and vLLM bound them
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_LOGIT_BIAS_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_model_len: int
    is_ascend: bool
    ascend_temperature_floor: float


def validate_prompt_ids(ids: list[int], limits: Limits) -> None:
    if not ids:
        raise InvalidRequestError("prompt", "must not be empty")
    check_vocabulary("prompt_token_ids", ids, limits.vocab_size)
    if len(ids) >= limits.max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"{len(ids)} tokens leave no room for a new token within max_model_len={limits.max_model_len}",
        )


def validate_params(params: SamplingParams, num_prompt_tokens: int, limits: Limits) -> SamplingParams:
    """Checks ranges; applies the Ascend temperature floor. Returns the params to use."""
    t = params.temperature
    if not math.isfinite(t) or t < 0:
        raise InvalidRequestError("sampling.temperature", f"must be >= 0, got {t}")
    if not math.isfinite(params.top_p) or not 0 < params.top_p <= 1:
        raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise InvalidRequestError("sampling.top_k", f"must be >= 0 (0 disables it), got {params.top_k}")
    if not math.isfinite(params.repetition_penalty) or params.repetition_penalty <= 0:
        raise InvalidRequestError("sampling.repetition_penalty", f"must be > 0, got {params.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequestError(
                f"sampling.{name}", f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}"
            )
    if len(params.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens")
    check_vocabulary("sampling.logit_bias", params.logit_bias, limits.vocab_size)
    for token, bias in params.logit_bias.items():
        if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequestError("sampling.logit_bias", f"token {token}: bias must be in [-100, 100], got {bias}")
    if not 0 <= params.min_tokens <= params.max_new_tokens:
        raise InvalidRequestError(
            "sampling.min_tokens", f"must be in 0..max_new_tokens ({params.max_new_tokens}), got {params.min_tokens}"
        )
    if params.max_new_tokens <= 0:
        raise InvalidRequestError("sampling.max_new_tokens", f"must be > 0, got {params.max_new_tokens}")
    if num_prompt_tokens + params.max_new_tokens > limits.max_model_len:
        raise InvalidRequestError(
            "sampling.max_new_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
            f"max_model_len={limits.max_model_len}",
        )
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {params.top_logprobs}")
    if len(params.stop) > MAX_STOP_STRINGS or any(not s for s in params.stop):
        raise InvalidRequestError("sampling.stop", f"up to {MAX_STOP_STRINGS} non-empty strings")
    check_vocabulary("sampling.stop_token_ids", params.stop_token_ids, limits.vocab_size)
    floor = limits.ascend_temperature_floor
    if limits.is_ascend and 0 < t < floor:
        # low temperatures overflow the fp16 softmax path of Ascend kernels (source material, pitfall list)
        log.warning("temperature %.3f raised to the Ascend floor %.2f", t, floor)
        params.temperature = floor
    return params
