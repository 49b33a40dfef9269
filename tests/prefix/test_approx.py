"""The approximate index of an engine without events: learnt prefixes match in chars,
count for the TTL after their last use, and stay within the bound."""

from __future__ import annotations

import pytest

from narwhal.prefix import TEXT_BLOCK_CHARS, PromptIndex, PromptKey, prompt_key

B = TEXT_BLOCK_CHARS


def key(*blocks: str, tail: str = "") -> PromptKey:
    """A prompt of one full text block per letter in `blocks`."""
    text = "".join(letter * B for letter in blocks) + tail
    return prompt_key(text, len(text) // 4)


def test_a_learnt_prompt_matches_its_longest_shared_prefix_in_chars() -> None:
    index = PromptIndex(max_blocks=100, ttl_s=300.0)
    assert index.match(key("a", "b", "c"), 0.0) == 0
    index.learn(key("a", "b", "c", tail="partial"), 0.0)
    assert index.match(key("a", "b", "c", "d"), 1.0) == 3 * B
    assert index.match(key("a", "b", "x"), 1.0) == 2 * B
    assert index.match(key("x", "b", "c"), 1.0) == 0
    stats = index.statistics()
    assert (stats.blocks, stats.learnt, stats.dropped, stats.expired) == (3, 1, 0, 0)


def test_blocks_unused_for_the_ttl_no_longer_count_and_are_dropped() -> None:
    index = PromptIndex(max_blocks=100, ttl_s=300.0)
    index.learn(key("a", "b"), 0.0)
    index.learn(key("a", "c"), 200.0)  # uses block "a" again
    assert index.match(key("a", "b"), 300.0) == 2 * B
    assert index.match(key("a", "b"), 300.5) == B
    assert index.statistics().expired == 1
    assert len(index) == 2
    assert index.match(key("a", "c"), 500.0) == 2 * B
    assert index.match(key("a", "c"), 500.5) == 0
    stats = index.statistics()
    assert (stats.blocks, stats.expired) == (0, 3)
    # A reload lowers the TTL in place: it applies to what is already learnt.
    index.learn(key("a"), 1000.0)
    index.ttl_s = 10.0
    assert index.match(key("a"), 1011.0) == 0


def test_the_bound_drops_the_least_recently_used_deepest_blocks_first() -> None:
    index = PromptIndex(max_blocks=4, ttl_s=300.0)
    index.learn(key("a", "b", "c"), 0.0)
    index.learn(key("x", "y", "z"), 1.0)
    # "c" and "b" went, "a" stays: what is left of the older prompt still matches.
    assert index.match(key("a", "b", "c"), 2.0) == B
    assert index.match(key("x", "y", "z"), 2.0) == 3 * B
    stats = index.statistics()
    assert (stats.blocks, stats.max_blocks, stats.dropped) == (4, 4, 2)


def test_reset_forgets_everything_and_counts_the_reason() -> None:
    index = PromptIndex(max_blocks=10, ttl_s=60.0)
    index.learn(key("a"), 0.0)
    index.reset("restart")
    index.reset("restart")
    index.reset("role_change")
    assert index.match(key("a"), 0.0) == 0
    assert index.statistics().resets == {"restart": 2, "role_change": 1}
    index.learn(key("a", "b"), 1.0)
    assert repr(index) == "<PromptIndex 2/10 blocks, ttl 60.0 s, 2 learnt, 3 resets>"


def test_a_bound_below_one_and_a_negative_ttl_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^max_blocks is 0; must be >= 1$"):
        PromptIndex(max_blocks=0, ttl_s=1.0)
    with pytest.raises(ValueError, match=r"^ttl_s is -1.0; must be >= 0$"):
        PromptIndex(max_blocks=1, ttl_s=-1.0)
