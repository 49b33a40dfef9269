"""A request's prompt as the engines' prefix caches see it
(docs/design.md#prefix-caching).

Owns
  `prompt_of`, the exchange's `PromptKey` (its text, and its token ids when the router
  has them: sent as ids, or counted by `engine.tokenizer_path`), which `Decisions`
  looks up in the caches and tells them of; and `prefills_locally`, whether a pair's
  decode engine computes the prompt itself (cache.local_prefill_share).

Invariants
  Without a caches service (`ServingContext.prefix_caches`) there is no key and
  nothing is cached: every price is the uncached one. A prompt the engine truncates
  (`truncate_prompt_tokens`) keeps only its tail, whose prefix is not the client's: it
  gets no key. The decision functions are pure.

Errors
  None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..prefix import PromptKey, prompt_key
from ._admit import LocalPrices
from ._request import prompt_text

if TYPE_CHECKING:
    from ._exchange import Exchange


def prompt_of(x: Exchange) -> PromptKey | None:
    if x.ctx.prefix_caches is None:
        return None
    request = x.request
    truncate = request.truncate_prompt_tokens
    if truncate is not None and truncate >= 0:
        return None
    ids = x.prompt_ids
    if ids is None and request.prompt_token_ids is not None:
        prompt = request.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        ids = prompt if isinstance(prompt, list) else None
    return prompt_key(prompt_text(request), x.tokens, ids)


def prefills_locally(
    held: int, tokens: int, share: float, price: Callable[[], LocalPrices]
) -> LocalPrices | None:
    """The prices on which the decode engine of a pair prefills the prompt itself, or
    None when it does not: it must hold at least `share` of the prompt's `tokens`
    (`held` of them) and, where both are priced, prefilling the rest there must be no
    slower than the prefill engine's path. `price` runs only once the share is met: it
    prices the whole fleet."""
    if tokens <= 0 or share >= 1.0 or held < share * tokens:
        return None
    prices = price()
    local_s, remote_s = prices.local_s, prices.remote_s
    return prices if local_s is None or remote_s is None or local_s <= remote_s else None
