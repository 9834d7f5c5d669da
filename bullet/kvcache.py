"""KV block manager: integer block ids, one table per request, one shared pool for both lanes."""

from __future__ import annotations


class KvCacheError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, req_id: int, num_tokens: int) -> int:
        """Blocks to add so that ``req_id`` holds ``num_tokens`` tokens."""
        table = self.tables.get(req_id)
        have = len(table) if table else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_hold(self, req_id: int, num_tokens: int, reserve: int = 0) -> bool:
        return self.extra_blocks(req_id, num_tokens) + reserve <= len(self._free)

    def allocate(self, req_id: int, num_tokens: int) -> list[int]:
        """Grow ``req_id``'s table to hold ``num_tokens`` tokens; returns the table (a live list)."""
        table = self.tables.get(req_id)
        if table is None:
            table = self.tables[req_id] = []
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self._free):
            raise KvCacheError(f"request {req_id} needs {need} blocks, {len(self._free)} free")
        if need > 0:
            self._take(table, need)
        return table

    def _take(self, table: list[int], n: int) -> None:
        """Move ``n`` blocks from the top of the free stack to ``table`` (in pop order)."""
        free = self._free
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        table.extend(taken)

    def grow(self, wants: list[tuple[int, int]]) -> None:
        """``allocate`` for many existing tables at once (the fused-decode hot path); all or nothing."""
        bs, tables, free = self.block_size, self.tables, self._free
        needs = [(tables[rid], -(-tokens // bs) - len(tables[rid])) for rid, tokens in wants]
        total = sum(n for _, n in needs)
        if total > len(free):
            raise KvCacheError(f"{len(wants)} requests need {total} blocks, {len(free)} free")
        for table, n in needs:
            if n == 1:
                table.append(free.pop())
            elif n > 0:
                self._take(table, n)

    def free(self, req_id: int) -> int:
        """Return every block of ``req_id`` to the pool (finish or preemption); returns how many."""
        table = self.tables.pop(req_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def check(self) -> None:
        """Invariants: every block is either free or in exactly one table; ids are in range."""
        owned = [b for t in self.tables.values() for b in t]
        everything = owned + self._free
        if len(everything) != self.num_blocks or set(everything) != set(range(self.num_blocks)):
            raise KvCacheError(f"block accounting broken: {len(owned)} owned + {len(self._free)} free "
                               f"!= {self.num_blocks}, or a block is held twice")
