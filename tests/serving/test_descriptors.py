"""listen.max_open_connections against RLIMIT_NOFILE: the sizing and the decision, as pure
functions and through OpenFileLimit with a fake limit (the test process's own is never
touched here; tests/ops/test_daemon.py runs the daemon under a low one)."""

from __future__ import annotations

import errno
import logging
from typing import Any

import pytest

from narwhal._records import to_json
from narwhal.config import Config, load_config
from narwhal.serving._descriptors import (
    OTHER_DESCRIPTORS,
    UNLIMITED,
    DescriptorLimitError,
    check_budget,
    descriptor_reserve,
    plan_descriptors,
    report,
)

from ..support import FakeFileLimit


def _config(engines: int = 2, **sections: Any) -> Config:
    return load_config(
        {
            "engines": [
                {"id": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}", "role": "both"}
                for i in range(engines)
            ],
            **sections,
        }
    )


def test_the_reserve_is_each_engines_two_pools_and_the_rest() -> None:
    # Defaults: a serving pool of serving.max_connections=512 per engine and a control
    # pool of two per engine with a minimum of four.
    assert OTHER_DESCRIPTORS == 200
    assert descriptor_reserve(_config(engines=2)) == 2 * (512 + 4) + 200
    assert descriptor_reserve(_config(engines=3)) == 3 * (512 + 6) + 200
    assert (
        descriptor_reserve(
            _config(engines=3, serving={"max_connections": 16}, engine={"control_connections": 10})
        )
        == 3 * (16 + 10) + 200
    )


def test_a_soft_limit_with_room_is_left_alone() -> None:
    budget = plan_descriptors(configured=4096, reserve=1000, soft=65536, hard=65536)
    assert (budget.soft, budget.effective, budget.raised, budget.capped) == (
        65536,
        4096,
        False,
        False,
    )
    unlimited = plan_descriptors(configured=4096, reserve=1000, soft=UNLIMITED, hard=UNLIMITED)
    assert (unlimited.soft, unlimited.effective, unlimited.raised) == (UNLIMITED, 4096, False)


def test_a_low_soft_limit_is_raised_to_what_is_needed_not_to_the_hard_limit() -> None:
    budget = plan_descriptors(configured=4096, reserve=1211, soft=1024, hard=524288)
    assert (budget.soft, budget.previous_soft, budget.needed, budget.effective) == (
        5307,
        1024,
        5307,
        4096,
    )
    assert budget.raised
    assert not budget.capped
    unlimited = plan_descriptors(configured=4096, reserve=1211, soft=1024, hard=UNLIMITED)
    assert (unlimited.soft, unlimited.effective) == (5307, 4096)


def test_under_a_low_hard_limit_the_connection_limit_is_what_the_reserve_leaves() -> None:
    budget = plan_descriptors(configured=4096, reserve=1211, soft=1024, hard=4096)
    assert (budget.soft, budget.effective, budget.configured) == (4096, 4096 - 1211, 4096)
    assert budget.raised
    assert budget.capped
    check_budget(budget, ceiling=512)  # 2885 connections is room enough for 512 requests
    # Already at the hard limit: nothing to raise, still capped.
    at_hard = plan_descriptors(configured=4096, reserve=1211, soft=4096, hard=4096)
    assert (at_hard.raised, at_hard.effective) == (False, 2885)


def test_a_limit_with_no_room_for_the_retained_requests_connections_is_refused() -> None:
    budget = plan_descriptors(configured=4096, reserve=1211, soft=1024, hard=1723)
    assert budget.effective == 512
    with pytest.raises(
        DescriptorLimitError,
        match=(
            r"^the hard open-file limit \(RLIMIT_NOFILE\) is 1723: with 1211 descriptors for "
            r"engine pools, sockets and files, it leaves room for 512 client connections, "
            r"which must exceed serving.max_connections \+ serving.queue_capacity = 512; "
            r"listen.max_open_connections=4096 needs 5307 in all: raise the hard limit "
            r"\(LimitNOFILE= in the unit, ulimit -Hn\) to at least that$"
        ),
    ):
        check_budget(budget, ceiling=512)
    none_left = plan_descriptors(configured=4096, reserve=1211, soft=1024, hard=1024)
    with pytest.raises(DescriptorLimitError, match=r"leaves room for 0 client connections"):
        check_budget(none_left, ceiling=512)


def test_fit_raises_the_soft_limit_of_the_process() -> None:
    limit = FakeFileLimit(soft=1024, hard=524288)
    budget = limit.limit().fit(_config(engines=2))
    assert limit.set_to == [(5328, 524288)]
    assert (budget.soft, budget.effective, budget.reserve) == (5328, 4096, 1232)
    assert to_json(budget.open_files()) == {
        "soft": 5328,
        "hard": 524288,
        "needed": 5328,
        "reserve": 1232,
        "raised_from": 1024,
        "note": None,
    }
    again = limit.limit().fit(_config(engines=2))  # as at a reload that changed nothing
    assert (limit.set_to, again.raised) == ([(5328, 524288)], False)


def test_fit_changes_nothing_when_it_refuses() -> None:
    limit = FakeFileLimit(soft=1024, hard=1500)
    with pytest.raises(DescriptorLimitError, match=r"^the hard open-file limit .* is 1500: "):
        limit.limit().fit(_config(engines=2))
    assert limit.set_to == []


def test_when_setrlimit_refuses_the_soft_limit_found_is_the_one_fitted() -> None:
    # Linux refuses a soft limit above fs.nr_open, even under an unlimited hard limit.
    refusal = OSError(errno.EPERM, "Operation not permitted")
    limit = FakeFileLimit(soft=4096, hard=UNLIMITED, refuse=refusal)
    budget = limit.limit().fit(_config(engines=2))
    assert (budget.soft, budget.hard, budget.effective, budget.raised) == (
        4096,
        UNLIMITED,
        4096 - 1232,
        False,
    )
    assert budget.note == (
        "raising the soft limit to 5328 failed: [Errno 1] Operation not permitted"
    )
    assert to_json(budget.open_files())["hard"] is None
    with pytest.raises(
        DescriptorLimitError, match=r"^the soft open-file limit \(RLIMIT_NOFILE\) is 1024: .*"
    ):
        FakeFileLimit(soft=1024, hard=UNLIMITED, refuse=refusal).limit().fit(_config(engines=2))


def test_what_changed_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.server")
    raised = plan_descriptors(configured=4096, reserve=1211, soft=1024, hard=65536)
    capped = plan_descriptors(configured=4096, reserve=1211, soft=1024, hard=4096)
    still_capped = plan_descriptors(configured=4096, reserve=1211, soft=4096, hard=4096)
    lower = plan_descriptors(configured=2000, reserve=1211, soft=4096, hard=4096)
    report(raised, None)
    report(capped, raised)
    report(still_capped, capped)  # a reload that changed nothing of it: silent
    report(lower, still_capped)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "INFO",
            "raised the soft open-file limit (RLIMIT_NOFILE) from 1024 to 5307: "
            "listen.max_open_connections=4096 and 1211 for engine pools, sockets and files",
        ),
        (
            "INFO",
            "raised the soft open-file limit (RLIMIT_NOFILE) from 1024 to 4096: "
            "listen.max_open_connections=4096 and 1211 for engine pools, sockets and files",
        ),
        (
            "WARNING",
            "listen.max_open_connections=4096 does not fit the open-file limit "
            "(RLIMIT_NOFILE, hard 4096): with 1211 descriptors for engine pools, sockets and "
            "files, at most 2885 client connections are kept open; raise the hard limit "
            "(LimitNOFILE= in the unit, ulimit -Hn) to 5307 for all of them",
        ),
        (
            "INFO",
            "listen.max_open_connections=2000 is in force again: the open-file limit has "
            "room for it",
        ),
    ]
    assert [getattr(r, "outcome", None) for r in caplog.records] == [
        "raised",
        "raised",
        "capped",
        "uncapped",
    ]
