"""Local tokenizers with real chat-template styles, built with the ``tokenizers`` library
(nothing downloaded), and an independent oracle of each style's expected mask.

Each style gives a byte-level BPE tokenizer (as Llama-3, Qwen and DeepSeek use) trained on
a small corpus, its special tokens, its Jinja template (written after the published one),
and ``pieces(messages)``: the rendering as (text, trainable) pieces written out by hand, so
a test can compare the computed mask with one that never went through the template.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Pieces = list[tuple[str, int]]
Messages = list[dict[str, str]]

CORPUS = [
    "hello world how are you today",
    "the quick brown fox jumps over the lazy dog",
    "assistant user system answer question model token",
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ! ? : ;",
]


@dataclass(frozen=True)
class Style:
    name: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    template: str
    pieces: Callable[[Messages], Pieces]
    bos_post_processor: bool = False  # the tokenizer adds BOS itself (Llama-3 does)


# --- Llama-3.1 (system header always present, with the date lines) ---------------------
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _llama3_pieces(messages: Messages) -> Pieces:
    system = ""
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    out: Pieces = [
        (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
            f"{system}<|eot_id|>",
            0,
        )
    ]
    for m in messages:
        header = f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
        body = m["content"].strip() + "<|eot_id|>"
        trainable = int(m["role"] == "assistant")
        out += [(header, 0), (body, trainable)]
    return out


# --- ChatML / Qwen2.5 (a default system prompt when the record has none) ---------------
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + QWEN_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same rendering with {% generation %} markers (the path that trusts the template).
CHATML_MARKED = CHATML.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}",
)


def _chatml_pieces(messages: Messages) -> Pieces:
    out: Pieces = []
    if messages[0]["role"] != "system":
        out.append((f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n", 0))
    for m in messages:
        trainable = int(m["role"] == "assistant")
        out += [(f"<|im_start|>{m['role']}\n", 0), (m["content"] + "<|im_end|>", trainable)]
        out.append(("\n", 0))
    return out


# --- DeepSeek-V3 (system text right after BOS, no header; end-of-turn is the EOS) --------
DEEPSEEK = (
    "{{ bos_token }}{%- set ns = namespace(system='') %}"
    "{%- for m in messages %}{%- if m['role'] == 'system' %}{%- set ns.system = m['content'] %}"
    "{%- endif %}{%- endfor %}{{ ns.system }}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}"
)


def _deepseek_pieces(messages: Messages) -> Pieces:
    systems = [m["content"] for m in messages if m["role"] == "system"]
    system = systems[-1] if systems else ""
    out: Pieces = [("<｜begin▁of▁sentence｜>" + system, 0)]
    for m in messages:
        if m["role"] == "user":
            out.append(("<｜User｜>" + m["content"], 0))
        elif m["role"] == "assistant":
            out += [("<｜Assistant｜>", 0), (m["content"] + "<｜end▁of▁sentence｜>", 1)]
    return out


# --- Kimi-K2 (role tokens, a middle token, <|im_end|> after every turn) ----------------
KIMI = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- else %}<|im_assistant|>assistant<|im_middle|>{{ m.content }}<|im_end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{%- endif %}"
)


def _kimi_pieces(messages: Messages) -> Pieces:
    out: Pieces = []
    for m in messages:
        role = m["role"]
        out += [(f"<|im_{role}|>{role}<|im_middle|>", 0)]
        out += [(m["content"] + "<|im_end|>", int(role == "assistant"))]
    return out


# --- A template whose assistant header contains the end-of-turn string ----------------
EOT_HEADER = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|end|>\n<|assistant|>{{ m.content }}<|end|>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|end|>\n<|assistant|>{%- endif %}"
)


def _eot_header_pieces(messages: Messages) -> Pieces:
    out: Pieces = []
    for m in messages:
        if m["role"] == "assistant":
            out += [("<|end|>\n<|assistant|>", 0), (m["content"] + "<|end|>", 1)]
        else:
            out.append((f"<|{m['role']}|>{m['content']}", 0))
    return out


STYLES = {
    "llama3": Style(
        "llama3",
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        LLAMA3,
        _llama3_pieces,
        bos_post_processor=True,
    ),
    "chatml": Style(
        "chatml", ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>", CHATML, _chatml_pieces
    ),
    "chatml-marked": Style(
        "chatml-marked",
        ("<|im_start|>", "<|im_end|>"),
        None,
        "<|im_end|>",
        CHATML_MARKED,
        _chatml_pieces,
    ),
    "deepseek": Style(
        "deepseek",
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        DEEPSEEK,
        _deepseek_pieces,
    ),
    "kimi": Style(
        "kimi",
        ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
        None,
        "<|im_end|>",
        KIMI,
        _kimi_pieces,
    ),
    "eot-header": Style(
        "eot-header",
        ("<|end|>", "<|assistant|>", "<|user|>", "<|system|>"),
        None,
        "<|end|>",
        EOT_HEADER,
        _eot_header_pieces,
    ),
}


def build_tokenizer(style: Style, path: Path) -> Path:
    """Train a small byte-level BPE with the style's special tokens; save it with the
    template as a local Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(style.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    if style.bos_post_processor and style.bos is not None:
        bos_id = tok.token_to_id(style.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{style.bos} $A",
            pair=f"{style.bos} $A $B",
            special_tokens=[(style.bos, bos_id)],
        )
    kwargs: dict[str, Any] = {"eos_token": style.eos}
    if style.bos is not None:
        kwargs["bos_token"] = style.bos
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        tokenizer_object=tok, chat_template=style.template, **kwargs
    )
    fast.add_special_tokens({"additional_special_tokens": list(style.specials)})
    fast.save_pretrained(path)
    return path


def expected(tokenizer: Any, style: Style, messages: Messages) -> tuple[list[int], list[int]]:
    """ids and mask from the hand-written pieces, each piece tokenized on its own."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trainable in style.pieces(messages):
        piece = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        ids += piece
        mask += [trainable] * len(piece)
    return ids, mask
