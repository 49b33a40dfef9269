"""The model's tokenizer in the router: exact prompt counts without an engine's /tokenize."""

from ._local import (
    MISS_REASONS as MISS_REASONS,
    LocalTokenizer as LocalTokenizer,
    load_tokenizer as load_tokenizer,
)
