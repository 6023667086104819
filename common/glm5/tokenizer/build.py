"""Builds the small byte-level BPE tokenizer of the tiny presets, with GLM-5's special tokens and chat format.

The corpus is generated here (arithmetic, chat phrases, code-like lines, common words), so the same
tokenizer comes out on every machine without downloads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# GLM-4.5/GLM-5 special tokens (the subset the serving stack uses).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
]
# A turn ends when the model starts the next speaker's turn or ends the text (GLM's generation_config).
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]

# GLM-style chat template: [gMASK]<sop>, role tokens, <think> blocks, tool calls as XML-ish key/value pairs.
# {TOOLS} is where the offered tools go (TOOL_RENDERINGS).
_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n"
    "<tools>\n{TOOLS}</tools>\n"
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% else %}<think></think>{% endif %}"
    "{{ m.content or '' }}"
    "{% for tc in (m.tool_calls or []) %}<tool_call>{{ tc.function.name }}"
    "{% for k, v in (tc.function.arguments | default({})).items() %}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else (v | tojson) }}</arg_value>{% endfor %}"
    "</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|>\n<tool_response>{{ m.content }}</tool_response>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
# How a template writes the offered tools: "json", each tool's definition as JSON on a line (GLM-5's own); or
# "signatures", each tool as `name(param, ...)`, its parameters in the schema's order, leaving out types,
# descriptions and schema keywords. The demo model uses signatures (issue 34, defect 7): at 1.4M parameters it
# could not learn to read a tool's name and parameters out of ~1,000 tokens of JSON written in varied ways
# (1.7% on held-out schema variants, docs/benchmarks.md o), and everything a call needs is in the signature.
TOOL_RENDERINGS = {
    "json": "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}",
    "signatures": (
        "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
        "{{ f.name }}({{ ((f.parameters or {}).properties or {}).keys() | join(', ') }})\n{% endfor %}"
    ),
}


def chat_template(tools: str = "json") -> str:
    """The chat template, with the offered tools written as TOOL_RENDERINGS[tools]."""
    return _CHAT_TEMPLATE.replace("{TOOLS}", TOOL_RENDERINGS[tools])


CHAT_TEMPLATE = chat_template("json")

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part over new sound take only little work know place year live me back "
    "give most very after thing our just name good sentence man think say great where help through much "
    "before line right too mean old any same tell boy follow came want show also around form three small "
    "set put end does another well large must big even such because turn here why ask went men read need "
    "land different home us move try kind hand picture again change off play spell air away animal house "
    "point page letter mother answer found study still learn should world high every near add food "
    "between own below country plant last school father keep tree never start city earth eye light "
    "thought head under story saw left model token cache attention sparse expert router worker request "
    "stream latency queue batch weight tensor layer sequence prompt reply question answer reason step "
    "first second therefore result sum carry digit number plus minus equals function argument call tool "
    "file path error return value true false"
).split()
_CODE = [
    "def {w}(x):\n    return x + {n}\n",
    "for i in range({n}):\n    print(i, '{w}')\n",
    "if {w} == {n}:\n    raise ValueError('{w}')\n",
    "import {w}\nfrom {w} import {w2}\n",
    "class {W}:\n    def __init__(self):\n        self.{w} = {n}\n",
]


def corpus(seed: int = 0, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            a, b = rng.randrange(10 ** rng.randint(1, 6)), rng.randrange(10 ** rng.randint(1, 6))
            out.append(f"What is {a} + {b}? <think>{a} + {b} = {a + b}</think>The answer is {a + b}.")
        elif kind == 1:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 16))).capitalize() + ".")
        elif kind == 2:
            w, w2 = rng.choice(_WORDS), rng.choice(_WORDS)
            out.append(rng.choice(_CODE).format(w=w, w2=w2, W=w.capitalize(), n=rng.randint(0, 999)))
        else:
            q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
            out.append(f"<|user|>\n{q}?<|assistant|>\n<think></think>{q.capitalize()}.")
    return out


def build_tokenizer(vocab_size: int = 1024, seed: int = 0) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


def write_tokenizer(out: Path, vocab_size: int = 1024, seed: int = 0) -> Tokenizer:
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size, seed)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "eos_token": EOS_TOKENS[0],
        "eos_tokens": EOS_TOKENS,
        "pad_token": EOS_TOKENS[0],
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": SPECIAL_TOKENS,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tok
