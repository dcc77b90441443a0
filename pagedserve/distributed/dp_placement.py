"""Where data-parallel replicas run on one host: threads per replica and disjoint core sets,
so N replicas do not fight over cores (each torch/OpenMP pool spins on its own cores)."""
from __future__ import annotations

import logging
import os
from typing import Optional

from pagedserve.config import EngineConfig

logger = logging.getLogger("pagedserve")


def threads_per_replica(config: EngineConfig) -> int:
    """``threads_per_replica``, else ``num_threads``, else the usable cores / replicas (>= 1)."""
    if config.threads_per_replica:
        return config.threads_per_replica
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.data_parallel_size)


def plan_cpus(num_replicas: int, threads: int) -> Optional[list[list[int]]]:
    """Disjoint core sets, ``threads`` cores each, from the cores this process may use; None
    (no pinning) when they do not fit."""
    cores = sorted(os.sched_getaffinity(0))
    if num_replicas * threads > len(cores):
        logger.warning("pagedserve: %d replicas x %d threads > %d usable cores: replicas are not pinned and will share cores",
                       num_replicas, threads, len(cores))
        return None
    return [cores[i * threads:(i + 1) * threads] for i in range(num_replicas)]
