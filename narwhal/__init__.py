"""Narwhal: a router daemon for prefill/decode disaggregated LLM serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    # Written at install time from the git tag (pyproject.toml, [tool.setuptools_scm]).
    __version__ = version("narwhal")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0.0"
