"""Engine prefix caches as vLLM names them: block hashes and the KV events that carry them.

Pure, and free of Narwhal's I/O, so that the simulator (which publishes events) and the
router (which indexes them, `BlockIndex`) compute the same hashes from the same token ids.
A prompt's `PromptKey` is what both indexes match: `BlockIndex` its token blocks,
`PromptIndex` (learnt from routed prompts, for engines without events) its text blocks.
"""

from ._approx import (
    PromptIndex as PromptIndex,
    PromptIndexStatistics as PromptIndexStatistics,
)
from ._events import (
    END_SEQ as END_SEQ,
    MEDIUM_GPU as MEDIUM_GPU,
    AllBlocksCleared as AllBlocksCleared,
    BlockRemoved as BlockRemoved,
    BlockStored as BlockStored,
    EventBatch as EventBatch,
    KvEvent as KvEvent,
    decode_batch as decode_batch,
    decode_seq as decode_seq,
    encode_batch as encode_batch,
    encode_seq as encode_seq,
)
from ._hashing import (
    NONE_HASH_SEED as NONE_HASH_SEED,
    ROOT_HASH as ROOT_HASH,
    block_hashes as block_hashes,
    external_hash as external_hash,
    hash_block as hash_block,
    root_hash as root_hash,
)
from ._index import (
    BlockIndex as BlockIndex,
    IndexStatistics as IndexStatistics,
    Seq as Seq,
    next_seq as next_seq,
)
from ._prompt import (
    TEXT_BLOCK_CHARS as TEXT_BLOCK_CHARS,
    PromptKey as PromptKey,
    prompt_key as prompt_key,
)
