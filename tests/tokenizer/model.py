"""A tiny model tokenizer folder, trained in-process in milliseconds, as the real tier's is.

A byte-level BPE like tools/engines/tiny_model.py's, with a post-processor that adds a
BOS token (so `add_special_tokens` changes a count) and a ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|begin|>"
SPECIAL = [BOS, "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def count(prompt):\n    return len(tokenizer.encode(prompt))\n",
    "The router counts every prompt before it admits the request.",
    "Is it raining in Tromso right now? It is snowing in Oslo.",
] * 20


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
    )
    return tok


def write_model(folder: Path, *, template: str | None = CHATML, in_config: bool = False) -> Path:
    """`folder` holding tokenizer.json, tokenizer_config.json and, unless `template`
    is None, the chat template (in chat_template.jinja, or in the config's
    `chat_template` when `in_config`)."""
    folder.mkdir(parents=True, exist_ok=True)
    train().save(str(folder / "tokenizer.json"))
    settings: dict[str, object] = {
        "bos_token": BOS,
        "eos_token": "<|im_end|>",
        "tokenizer_class": "TokenizersBackend",
    }
    if template is not None and in_config:
        settings["chat_template"] = template
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder
