"""The router's own count of a prompt equals what the model's tokenizer gives for the text
the engine tokenises (vLLM's completions and chat rendering), or is not made, with a reason."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from narwhal.tokenizer import LocalTokenizer, load_tokenizer

from .model import CHATML, write_model

VLLM = {"vllm"}
QUESTION = [{"role": "user", "content": "Is it raining in Tromso right now?"}]


def local(folder: Path) -> LocalTokenizer:
    tokenizer, problem = load_tokenizer(str(folder))
    assert problem is None
    assert tokenizer is not None
    return tokenizer


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model")


def library(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_a_completion_is_counted_with_the_special_tokens_vllm_adds(model: Path) -> None:
    tokenizer, reference = local(model), library(model)
    prompt = "def count(prompt):\n    return len(prompt) # ünïcode ✓"
    with_bos = len(reference.encode(prompt).ids)
    assert tokenizer.count("completions", {"prompt": prompt}, VLLM) == with_bos
    # A one-prompt list is that prompt.
    assert tokenizer.count("completions", {"prompt": [prompt]}, VLLM) == with_bos
    unmarked = {"prompt": prompt, "add_special_tokens": False}
    assert tokenizer.count("completions", unmarked, VLLM) == with_bos - 1
    # SGLang adds them whatever the body says: a fleet with one cannot be counted here.
    assert tokenizer.count("completions", unmarked, {"vllm", "sglang"}) == "dialect"
    assert tokenizer.count("completions", {"prompt": prompt}, {"sglang"}) == with_bos


def test_a_chat_is_its_messages_rendered_through_the_template_then_encoded(model: Path) -> None:
    tokenizer, reference = local(model), library(model)
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Is it raining in Tromso?", "name": "ola"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "Now?"}, "Or later?"]},
    ]
    text = (
        "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
        "<|im_start|>user\nIs it raining in Tromso?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>user\nNow?\nOr later?<|im_end|>\n"
    )
    expected = len(reference.encode(text + "<|im_start|>assistant\n", add_special_tokens=False))
    assert tokenizer.count("chat", {"messages": messages}, VLLM) == expected
    body = {"messages": messages, "add_generation_prompt": False}
    assert tokenizer.count("chat", body, VLLM) == len(
        reference.encode(text, add_special_tokens=False)
    )


def test_the_template_renders_in_transformers_environment(tmp_path: Path) -> None:
    # trim_blocks and lstrip_blocks, loop controls, the special tokens by name, a tojson
    # that keeps non-ASCII, and the {% generation %} tag.
    template = (
        "{{ bos_token }}\n"
        "  {% for message in messages %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% generation %}[{{ message['role'] }}]{{ message['content'] | tojson }}"
        "{% endgeneration %}\n"
        "  {% endfor %}\n"
        "{{ eos_token }}"
    )
    folder = write_model(tmp_path / "model", template=template, in_config=True)
    tokenizer, reference = local(folder), library(folder)
    messages = [{"role": "user", "content": "blåbær <b>"}] * 3
    # As transformers renders it (checked against its render_jinja_template): the line
    # break after an expression stays, those after block tags go.
    text = '<|begin|>\n[user]"blåbær <b>"[user]"blåbær <b>"<|im_end|>'
    expected = len(reference.encode(text, add_special_tokens=False))
    assert tokenizer.count("chat", {"messages": messages}, VLLM) == expected


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "fields"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "fields"),
        ({"chat_template": "{{ messages }}"}, "fields"),
        ({"documents": [{"title": "t", "text": "x"}]}, "fields"),
        ({"reasoning_effort": "low"}, "fields"),
        ({"continue_final_message": True, "add_generation_prompt": False}, "fields"),
        ({"add_special_tokens": True}, "fields"),
        ({"add_generation_prompt": "yes"}, "fields"),
        ({"messages": [{"role": "developer", "content": "Be brief."}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "a"}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": []}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:"}}],
                    }
                ]
            },
            "messages",
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cc=1\nHi"}]},
            "messages",
        ),
    ],
)
def test_a_chat_not_rendered_as_vllm_would_is_a_miss(
    model: Path, fields: dict[str, Any], reason: str
) -> None:
    assert local(model).count("chat", {"messages": QUESTION, **fields}, VLLM) == reason


def test_a_chat_the_template_refuses_or_with_sglang_engines_is_a_miss(tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    folder = write_model(tmp_path / "model", template=template)
    assert local(folder).count("chat", {"messages": QUESTION}, VLLM) == "template_error"
    assert local(folder).count("chat", {"messages": QUESTION}, {"vllm", "sglang"}) == "dialect"


@pytest.mark.parametrize(
    "template",
    [
        # vLLM hands such templates content as parts ("openai" content format).
        "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}"
        "{% endfor %}",
        "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}"
        "{% endfor %}{% endfor %}",
        "{% macro text(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ text(m.content) }}{% endfor %}",
    ],
)
def test_a_template_that_loops_over_content_is_not_rendered_here(
    tmp_path: Path, template: str
) -> None:
    folder = write_model(tmp_path / "model", template=template)
    assert local(folder).count("chat", {"messages": QUESTION}, VLLM) == "template_parts"


def test_without_a_template_chats_are_misses_and_completions_are_counted(tmp_path: Path) -> None:
    folder = write_model(tmp_path / "model", template=None)
    tokenizer = local(folder)
    assert tokenizer.count("chat", {"messages": QUESTION}, VLLM) == "no_template"
    assert tokenizer.count("completions", {"prompt": "hi"}, VLLM) == len(
        library(folder).encode("hi").ids
    )
    assert tokenizer.count("completions", {"prompt": ["a", "b"]}, VLLM) == "prompt"
    # A processor's template comes first in vLLM (a multimodal model's): not rendered here.
    folder = write_model(tmp_path / "vision")
    (folder / "preprocessor_config.json").write_text("{}")
    assert local(folder).count("chat", {"messages": QUESTION}, VLLM) == "no_template"


def test_the_template_file_comes_before_the_config_and_named_templates_give_default(
    tmp_path: Path,
) -> None:
    folder = write_model(tmp_path / "model", template="{{ 'from config' }}", in_config=True)
    (folder / "chat_template.jinja").write_text(CHATML)
    tokenizer = local(folder)
    assert tokenizer.count("chat", {"messages": QUESTION}, VLLM) == local_chatml(tmp_path)
    named = write_model(tmp_path / "named", template=None)
    config = named / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": CHATML},
    ]
    config.write_text(json.dumps(settings))
    assert local(named).count("chat", {"messages": QUESTION}, VLLM) == local_chatml(tmp_path)


def local_chatml(tmp_path: Path) -> int:
    folder = write_model(tmp_path / "chatml")
    count = local(folder).count("chat", {"messages": QUESTION}, VLLM)
    assert isinstance(count, int)
    return count


def test_a_tokenizer_file_names_itself_and_two_loads_of_the_same_files_are_equal(
    model: Path,
) -> None:
    by_folder, by_file = local(model), local(model / "tokenizer.json")
    assert by_folder == by_file
    assert by_folder.path == str(model / "tokenizer.json")
    (model / "chat_template.jinja").write_text(CHATML + " ")
    assert local(model) != by_folder


@pytest.mark.parametrize(
    ("setup", "problem"),
    [
        (lambda folder: (folder / "tokenizer.json").unlink(), r'"{file}": no such file'),
        (
            lambda folder: (folder / "tokenizer.json").write_text('{"model": 1}'),
            r'"{file}": not a tokenizer the tokenizers library reads: .+',
        ),
        (
            lambda folder: (folder / "tokenizer_config.json").write_text("[]"),
            r'"{folder}/tokenizer_config.json": not a JSON object',
        ),
        (
            lambda folder: (folder / "chat_template.jinja").write_text("{% for %}"),
            r"{folder}/: its chat template does not compile: .+",
        ),
    ],
)
def test_a_tokenizer_that_cannot_be_used_is_refused_with_the_file_named(
    model: Path, setup: Any, problem: str
) -> None:
    setup(model)
    tokenizer, found = load_tokenizer(str(model))
    assert tokenizer is None
    assert found is not None
    pattern = problem.format(file=model / "tokenizer.json", folder=model)
    assert re.fullmatch(pattern, found), found


def test_a_worker_process_gets_the_tokenizer_by_reading_the_same_files(model: Path) -> None:
    tokenizer = local(model)
    copy = pickle.loads(pickle.dumps(tokenizer))  # as a Config travels to a worker
    assert copy == tokenizer
    body: dict[str, object] = {"prompt": "def count(prompt): return len(prompt)"}
    assert copy.count("completions", body, VLLM) == tokenizer.count("completions", body, VLLM)
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text() + " ")
    with pytest.raises(ValueError, match=r"changed since the core read it$"):
        pickle.loads(pickle.dumps(tokenizer))
