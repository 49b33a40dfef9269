"""The multi-process data plane: one decision core, W worker processes
(docs/architecture.md#workers)."""

from ._channel import (
    Channel as Channel,
    ChannelStatistics as ChannelStatistics,
    PeerGone as PeerGone,
    RemoteFailure as RemoteFailure,
)
