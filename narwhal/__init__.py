"""Narwhal: a router daemon for prefill/decode disaggregated LLM serving."""

__version__ = "0.1.0.dev0"
