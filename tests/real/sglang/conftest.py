"""The real-engine tier's SGLang part: Narwhal (`dialect: sglang`) against real SGLang.

The engines (`tests/real/sglang_engines.py`: one aggregate engine and one Mooncake P/D pair)
start when the first test of this folder runs and are reaped when its last one has run
(package scope). The folder's tests run after the rest of the real tier, so the SGLang
engines start once the vLLM tests are done (the vLLM fleet, session-scoped, stays up until
the session ends), and running these tests alone starts no vLLM engine. A failed test gets
a report section per engine with what it logged during the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..client import scrape
from ..conftest import FLEET, LOG_OFFSETS, MODEL, real_config
from ..engines import Engine, sample
from ..sglang_engines import SGLangFleet, sglang_fleet

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's tests after all others (the root conftest then puts the real tier
    last, keeping this order): the SGLang engines never start while vLLM's tests run."""
    items.sort(key=lambda item: HERE in Path(item.fspath).parents)


@pytest.fixture(scope="package")
def sglang_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangFleet]:
    """The SGLang engines, up for this folder's tests (logs in the session's tmp folder)."""
    with sglang_fleet(tmp_path_factory.mktemp("sglang-fleet")) as fleet:
        yield fleet


@pytest.fixture
def sglang(request: pytest.FixtureRequest, sglang_engines: SGLangFleet) -> SGLangFleet:
    """The fleet, every engine healthy: one a test before left dead is relaunched first."""
    relaunched = sglang_engines.heal()
    if relaunched:
        print(f"relaunched SGLang engine(s) {relaunched} that an earlier test left dead")
    request.node.stash[FLEET] = sglang_engines
    request.node.stash[LOG_OFFSETS] = {
        name: engine.log_size() for name, engine in sglang_engines.engines.items()
    }
    return sglang_engines


def sglang_entry(engine: Engine, role: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": engine.name,
        "url": engine.url,
        "role": role,
        "model": MODEL,
        "dialect": "sglang",
        **extra,
    }


def aggregate_config(fleet: SGLangFleet, **sections: Any) -> dict[str, Any]:
    sections.setdefault("profiles", {"path": str(fleet.directory / "no-profiles.json")})
    return real_config([sglang_entry(e, "both") for e in fleet.aggregate], **sections)


def pair_config(fleet: SGLangFleet, **sections: Any) -> dict[str, Any]:
    prefill, decode = fleet.pair
    sections.setdefault("profiles", {"path": str(fleet.directory / "no-profiles.json")})
    return real_config(
        [
            sglang_entry(prefill, "prefill", bootstrap_port=fleet.bootstrap_port),
            sglang_entry(decode, "decode"),
        ],
        **sections,
    )


async def total(engine: Engine, name: str, **labels: str) -> float:
    """The sum of an SGLang counter's samples. SGLang exports a labelled counter from its
    first increment on (`sglang:prompt_tokens_total` after the first finished request), so
    a counter the page does not have yet is at zero."""
    try:
        return sample(await scrape(engine), name, **labels)
    except KeyError:
        return 0.0
