"""Everything that runs beside the requests, under one nursery."""

from ._supervisor import Supervisor as Supervisor
