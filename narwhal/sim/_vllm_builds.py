"""What each simulated vLLM build does differently, as one table.

Owns: `VLLM_BUILDS` (version -> `VllmBuild`), `DEFAULT_VLLM_VERSION`.
Invariants: a behaviour that differs between the builds Narwhal supports is a field here,
read by the vLLM protocol (`_vllm`) where it answers; what every build does alike has
no field.
See: tests/conformance (the 0.32 build checked against answers recorded on real vLLM),
docs/design.md#engine-wire-facts (what the 0.29 build plays, as the notes describe it).

Rules, per build:

=====================================  ==========================  ==========================
behaviour                              0.29.0                      0.32.0 (default)
=====================================  ==========================  ==========================
prompt + max_tokens over the context   refused (param max_tokens)  served, output capped
prompt alone over the context          refused (prompt >= L)       refused (prompt > L; a
                                                                   prompt of exactly L gets
                                                                   "max_tokens ... got 0")
max_tokens above max_model_len         refused as over the context refused on its own
completion ``max_tokens: null``        no bound                    16, as a missing one
``stream_options`` with no ``stream``  pydantic's wording          refused only when not {}
``stream_options.include_usage``       true unless false           false unless true
answer and chunk fields                design.md#engine-streams    vLLM 0.32 (ec_transfer_params,
                                                                   metrics, routed_experts,
                                                                   system_fingerprint, ...)
unknown model                          "does not exist."           "... Valid aliases: m."
=====================================  ==========================  ==========================

Both builds serve ``n > 1``, logprobs and stop strings, and answer the engine's input
checks (token ids out of vocabulary, logprobs above 20) after a stream's 200 as an error
event with code 400 then ``[DONE]``: vLLM's v1 engine runs them inside its generator.
"""

from __future__ import annotations

from typing import Literal

import attrs

ContextRule = Literal["prompt_and_output", "prompt_alone"]


@attrs.frozen(kw_only=True)
class VllmBuild:
    version: str
    # "prompt_and_output": prompt + max_tokens must fit the context; "prompt_alone": the
    # output is capped at what the context leaves and only the prompt must fit.
    context_rule: ContextRule
    # A completion's max_tokens null: its default (16), or no bound at all.
    null_max_tokens_is_default: bool
    # stream_options' include_usage when the object is there without it.
    include_usage_default: bool
    # Answers, chunks and error wording as vLLM 0.32 sends them.
    wire_032: bool


VLLM_BUILDS: dict[str, VllmBuild] = {
    "0.29.0": VllmBuild(
        version="0.29.0",
        context_rule="prompt_and_output",
        null_max_tokens_is_default=False,
        include_usage_default=True,
        wire_032=False,
    ),
    "0.32.0": VllmBuild(
        version="0.32.0",
        context_rule="prompt_alone",
        null_max_tokens_is_default=True,
        include_usage_default=False,
        wire_032=True,
    ),
}
DEFAULT_VLLM_VERSION = "0.32.0"
