"""Build a tiny random-weight Llama and a locally trained tokenizer, for real-engine tests.

Nothing is downloaded: the weights are random (seeded) and the tokenizer is a byte-level BPE
trained on this Python's own standard-library sources, wrapped as a fast tokenizer with a chat
template so that `/v1/chat/completions` works. Run it with the engines' venv (it needs torch,
transformers and tokenizers):

    .venv-vllm/bin/python tools/engines/tiny_model.py OUT_DIR

The answers are meaningless text; what the tests need is an engine that tokenises, prefills,
decodes, streams and hands KV over exactly as it would for a real model. Written in seconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sysconfig

VOCAB_SIZE = 2048
CONTEXT = 2048
SEED = 20261205

# ChatML-style: each message framed by its role, and the assistant's turn opened when asked.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(limit_bytes: int = 1_000_000) -> list[str]:
    """The first few MB of the standard library, in a fixed order so the vocabulary is stable."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def build_tokenizer(out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: pathlib.Path, vocab_size: int, eos_id: int, bos_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=bos_id,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)


def build(out: pathlib.Path) -> pathlib.Path:
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    build_model(out, len(tok), tok.eos_token_id, tok.bos_token_id)
    (out / "narwhal-tiny.json").write_text(
        json.dumps({"vocab_size": len(tok), "context": CONTEXT, "seed": SEED}) + "\n"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="folder to write the model into")
    args = parser.parse_args()
    print(build(args.out))


if __name__ == "__main__":
    main()
