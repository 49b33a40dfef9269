"""Several Narwhal replicas coordinating through etcd (`ClusterService`)."""

from ._facts import What as What
from ._profiles import SharedProfiles as SharedProfiles
from ._service import (
    ClusterSection as ClusterSection,
    ClusterService as ClusterService,
    ClusterUnavailable as ClusterUnavailable,
    replica_name as replica_name,
)
