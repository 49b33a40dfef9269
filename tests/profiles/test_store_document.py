"""A store's bytes apart from their parsing (`StoreDocument`): read from a file or kept
elsewhere (the cluster's etcd key), told apart by their digest, parsed and checked as a
file's are."""

from __future__ import annotations

import hashlib
from pathlib import Path

from narwhal.profiles import (
    StoreDocument,
    check_document,
    load_profiles,
    parse_document,
    read_document,
    read_store,
    save_profiles,
)

from .helpers import config_for, store_for

URLS = {"e0": "http://127.0.0.1:1", "e1": "http://127.0.0.1:2"}


def test_a_files_document_parses_and_checks_as_the_file_does(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    save_profiles(store_for(URLS), path)
    document = read_document(path)
    data = path.read_bytes()
    assert (document.source, document.data, document.problems) == (str(path), data, ())
    assert document.digest == hashlib.sha256(data).hexdigest()
    assert parse_document(document) == read_store(path)
    config = config_for(URLS, profiles=str(path))
    assert check_document(document, config) == load_profiles(None, config)
    assert check_document(document, config).usable == {"e0", "e1"}


def test_bytes_from_elsewhere_are_named_by_their_source() -> None:
    where = "etcd key /narwhal/profiles"
    assert parse_document(StoreDocument(where, b"{")) == (
        None,
        [
            f"{where}: not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)"
        ],
    )
    store, problems = parse_document(StoreDocument(where, b"\xff"))
    assert store is None
    assert problems[0].startswith(f"{where}: cannot read profile store: 'utf-8' codec")
    assert parse_document(StoreDocument(where, b'{"schema_version": 2}'))[1] == [
        f"{where}: schema_version is 2; this Narwhal reads schema_version 1: run "
        "narwhal-profile again"
    ]


def test_a_missing_file_has_no_bytes_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    document = read_document(path)
    missing = f"{path}: profile store is missing; run narwhal-profile --config FILE"
    assert (document.data, document.digest, document.problems) == (None, None, (missing,))
    assert parse_document(document) == (None, [missing])
    # The digest tells stores apart, and the same bytes from two places alike.
    assert StoreDocument("a", b"x").digest == StoreDocument("b", b"x").digest
    assert StoreDocument("a", b"x").digest != StoreDocument("a", b"y").digest
