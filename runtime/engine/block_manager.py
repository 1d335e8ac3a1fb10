"""Paged KV-cache block accounting with prefix reuse.

Blocks are fixed-size pages of the KV cache. A full block whose tokens (and all tokens before it) match another
sequence's is shared: its key is a hash chained over the blocks before it, so equal keys mean equal prefixes.
Freed blocks that hold a hashed prefix stay findable (least recently freed evicted first) until reused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from envex.runtime.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 prefix_limit: Callable[[Sequence, list[int], int], int] | None = None) -> None:
        """prefix_limit(seq, hashes, cached): of the `cached` leading blocks of a new prompt found in the cache
        (hashes: the chained hashes of all its blocks that could be), how many it may reuse; None: all. A model
        with per-sequence state can reuse a prefix only where it holds that state (state_slots.py)."""
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_limit = prefix_limit
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block id -> chained hash of its content
        self._block_of: dict[int, int] = {}  # chained hash -> block id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed blocks with no user, oldest first
        self._seq_hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def _chain(self, seq: Sequence, upto_blocks: int) -> list[int]:
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        tokens = seq.all_token_ids
        bs = self.block_size
        while len(hashes) < upto_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            hashes.append(hash((parent, tuple(tokens[i * bs:(i + 1) * bs]))))
        return hashes

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._ref[block] = 1
        return block

    def match_prefix(self, seq: Sequence) -> None:
        """Attach cached blocks holding a prefix of a new sequence's prompt; at least one token stays to compute."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return
        max_blocks = (len(seq.prompt_token_ids) - 1) // self.block_size
        hashes = self._chain(seq, max_blocks)[:max_blocks]
        cached = next((i for i, h in enumerate(hashes) if h not in self._block_of), len(hashes))
        if self.prefix_limit is not None:
            cached = self.prefix_limit(seq, hashes, cached)
        for h in hashes[:cached]:
            block = self._block_of[h]
            if self._ref[block] == 0:
                self._evictable.pop(block, None)
            self._ref[block] += 1
            seq.block_table.append(block)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_cached_prefix_tokens = seq.num_computed_tokens

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the sequence's block table to hold num_tokens; False (and nothing taken) if blocks run out."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take() for _ in range(needed))
        return True

    def commit(self, seq: Sequence) -> None:
        """Publish the sequence's newly computed full blocks so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose every token is known: a pending token (overlapped scheduling) has no value to hash yet.
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        # _chain may already hold the hashes of the whole prompt (match_prefix computes them): only the first
        # `full` blocks are computed and present in the block table.
        for i, h in enumerate(self._chain(seq, full)[:full]):
            block = seq.block_table[i]
            if block in self._hash_of or h in self._block_of:
                continue
            self._hash_of[block] = h
            self._block_of[h] = block

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # tail first: the shared prefix is evicted last
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        self._seq_hashes.pop(seq.request_id, None)
