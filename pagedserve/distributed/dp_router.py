"""The data-parallel router: which engine replica a new request goes to.

Torch-free and I/O-free: the front's DP client (:mod:`pagedserve.engine.dp_client`) feeds it
each replica's prefix-cache events and its own count of in-flight sequences per replica, and
asks :meth:`DPRouter.choose` for a replica.

Policies (``--router``):

* ``round-robin``: the next live replica in turn.
* ``least-loaded``: the live replica with the fewest in-flight sequences (sent by this front
  and not yet finished or aborted); ties go round-robin.
* ``kv-aware`` (default): the replica that already caches the longest run of the request's
  leading block hashes, unless that replica's queue is too long. Each replica publishes the
  hashes its block pool stores and evicts (vLLM's KV events; llm-d's "precise prefix-cache
  scorer" keeps the same per-replica index), so the router holds an exact mirror of every
  replica's prefix-cache index. The trade against load (after SGLang's cache-aware router,
  which switches to least-loaded past a load imbalance): with ``m_r`` of the request's ``n``
  leading blocks cached on replica ``r`` and ``L`` the shortest queue, ``r`` may be chosen
  only if ``load_r - L <= balance_slack * m_r / n``. A replica holding the whole prefix may
  thus run ``balance_slack`` more sequences than the least-loaded one; one holding half of it,
  half as many; one holding none only ties with the least-loaded. Among the allowed
  replicas the longest match wins, then the shorter queue, then round-robin order. So a hot
  prefix stays on its replica until that replica is ``balance_slack`` sequences ahead, then
  spills over once (the other replica computes and caches it) and is balanced from then on.
  A request counts as cached on its replica from the moment it is routed until it finishes
  (``note_routed`` / ``note_done``: its blocks will be computed there), so a burst sharing a new
  prefix follows its first request instead of scattering before that replica's first events.

Block hashes are computed with the replicas' own function and seed
(:func:`pagedserve.core.kv_cache_manager.hash_block_tokens`, seed from each replica's ready
message), over the prompt's full blocks up to ``num_tokens - 1`` (a replica's hit cap).
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagedserve.core.kv_cache_manager import hash_block_tokens
from pagedserve.lora_request import first_block_extra_keys

POLICIES = ("kv-aware", "least-loaded", "round-robin")
DEFAULT_BALANCE_SLACK = 4


def prompt_block_hashes(
    seed: bytes, token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None, lora_key: Optional[str] = None
) -> list[bytes]:
    """Chained hashes of the blocks a replica could serve from its prefix cache: the full
    blocks of ``token_ids[:-1]`` (as ``KVCacheManager.update_block_hashes``, the salt and the
    LoRA adapter's digest mixed into the first block only). Returns 16-byte hashes, one per block."""
    out: list[bytes] = []
    parent = seed
    for i in range((len(token_ids) - 1) // block_size):
        extra = first_block_extra_keys(cache_salt, lora_key) if i == 0 else None
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


class DPRouter:
    """Routing state of ``num_replicas`` replicas.

    Args:
        num_replicas: replicas, indexed 0..N-1.
        policy: one of :data:`POLICIES`.
        block_size: tokens per KV block (the replicas').
        seeds: each replica's block-hash seed (they differ only when replicas resolved the
            model to different paths).
        balance_slack: see the module docstring (sequences).

    Raises:
        ValueError: an unknown policy or a bad size.
    """

    def __init__(
        self,
        num_replicas: int,
        policy: str = "kv-aware",
        block_size: int = 16,
        seeds: Optional[Sequence[bytes]] = None,
        balance_slack: int = DEFAULT_BALANCE_SLACK,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {policy!r}")
        if num_replicas < 1 or block_size < 1:
            raise ValueError(f"need at least one replica and a positive block size, got {num_replicas}, {block_size}")
        self.policy = policy
        self.block_size = block_size
        self.seeds = list(seeds) if seeds is not None else [b""] * num_replicas
        self.balance_slack = balance_slack
        self.cached: list[set[bytes]] = [set() for _ in range(num_replicas)]
        self.pending: list[dict[bytes, int]] = [{} for _ in range(num_replicas)]  # hash -> in-flight requests
        self.load = [0] * num_replicas
        self.alive = [True] * num_replicas
        self._next = 0  # round-robin position

    @property
    def num_replicas(self) -> int:
        return len(self.alive)

    # -- fed by the DP client ------------------------------------------------------------
    def apply_events(self, replica: int, events: list) -> None:
        """Fold in a replica's KV events (``EngineCoreOutputs.kv_events``)."""
        index = self.cached[replica]
        for kind, hashes in events:
            if kind == "stored":
                index.update(hashes)
            elif kind == "removed":
                index.difference_update(hashes)
            elif kind == "cleared":
                index.clear()

    def note_routed(self, replica: int, hashes: Sequence[bytes]) -> None:
        """A request with these leading block hashes was sent to ``replica``."""
        pending = self.pending[replica]
        for h in hashes:
            pending[h] = pending.get(h, 0) + 1

    def note_done(self, replica: int, hashes: Sequence[bytes]) -> None:
        """That request finished or left ``replica`` (what it cached arrives as events)."""
        pending = self.pending[replica]
        for h in hashes:
            n = pending.get(h, 0) - 1
            if n > 0:
                pending[h] = n
            else:
                pending.pop(h, None)

    def mark_dead(self, replica: int) -> None:
        """Take a replica out of rotation for good (its index is dropped)."""
        self.alive[replica] = False
        self.cached[replica].clear()
        self.pending[replica].clear()
        self.load[replica] = 0

    # -- routing ---------------------------------------------------------------------------
    def wants_hashes(self) -> bool:
        return self.policy == "kv-aware"

    def request_hashes(self, token_ids: Sequence[int], cache_salt: Optional[str] = None, lora_key: Optional[str] = None) -> dict[bytes, list[bytes]]:
        """A request's leading block hashes under each distinct replica seed."""
        return {seed: prompt_block_hashes(seed, token_ids, self.block_size, cache_salt, lora_key) for seed in set(self.seeds)}

    def matched_blocks(self, replica: int, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` that ``replica`` caches or is computing for a request in
        flight (its longest prefix hit)."""
        index, pending = self.cached[replica], self.pending[replica]
        n = 0
        for h in hashes:
            if h not in index and h not in pending:
                break
            n += 1
        return n

    def choose(self, hashes: Optional[dict[bytes, list[bytes]]] = None) -> int:
        """The replica for a new request (``hashes`` from :meth:`request_hashes`; used by
        ``kv-aware`` only). Does not change the load: the caller counts what it sends.

        Raises:
            RuntimeError: no replica is alive.
        """
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise RuntimeError("no engine replica is alive")
        n = len(self.alive)
        order = sorted(live, key=lambda i: (i - self._next) % n)  # round-robin order from _next
        if self.policy == "round-robin":
            pick = order[0]
        else:
            shortest = min(self.load[i] for i in live)
            pick = min(order, key=lambda i: self.load[i])  # first in turn among the shortest queues
            if self.policy == "kv-aware" and hashes:
                best = (0, 0)
                for i in order:
                    hs = hashes.get(self.seeds[i], [])
                    if not hs:
                        continue
                    m = self.matched_blocks(i, hs)
                    if m and self.load[i] - shortest <= self.balance_slack * m / len(hs) and (m, -self.load[i]) > best:
                        best, pick = (m, -self.load[i]), i
        self._next = (pick + 1) % n
        return pick
