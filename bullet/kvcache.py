"""KV block manager: integer block ids, one table per request, one pool shared by both lanes, and an optional
prefix cache.

Prefix cache: a full block whose KV has been computed is remembered under ``(parent node, content)``: each
cached block gets a node number never used again, the parent is the node of the cached block before it in the
same request (``ROOT`` for the first), and the content is the block's token ids or, for a trace that only
names its prompt blocks, the trace's hash id and the offset in it (:func:`block_keys`). The key is the content
itself, not a digest of it, and a node number names one cached block's whole prefix, so two blocks share a
key only when their whole prefixes are equal: a lookup can miss, but never returns another prompt's KV. When a
block is evicted, blocks cached under it become unreachable (their parent's number never comes back) and
simply age out. A cached block held by several requests is counted once per extra holder (``_shared``); when
no request holds it, it waits in an LRU list and counts as free, and is evicted only when the pool needs it:
plain free blocks are handed out first.

Reserved blocks: a table may hold blocks that have no id yet. ``held`` counts each table's blocks, named ones
(its list in ``tables``) and reserved ones; the reserved ones are plain free blocks set aside (``num_free`` leaves
them out, and the cache is evicted for them when they are reserved, as it would be for named ones), and get their
ids when the table is read (:meth:`BlockManager.table`). A fused decode stretch grows hundreds of tables by
several blocks each (:meth:`BlockManager.grow`, :meth:`BlockManager.reserve`), and naming every block cost half of
a bullet decode decision over 256 requests (bench/RESULTS.md, issue 10); the simulator never reads a decode
table's ids, so it never names them, and an executor reads them through ``DecodeChunks``, which names them when
first read. Which ids a table gets is no part of any simulated number: what the pool and the cache hold, and when
the cache is evicted, are the same counts as when every block was named at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from .request import Request

ROOT = -1  # the parent of a request's first block
_HASH = "#"  # tags trace-hash contents so that they never equal a tuple of token ids


class KvCacheError(RuntimeError):
    pass


def keyed_blocks(req: Request, block_size: int) -> int:
    """How many leading full blocks of ``req`` have a known content: blocks of its token ids (prompt and
    any output ids read back), else of its prompt's trace hashes, else none."""
    if req.prompt_ids is not None:
        return (req.prompt_len + len(req.output_ids)) // block_size
    if req.hash_ids is not None:
        return req.prompt_len // block_size
    return 0


def block_keys(req: Request, block_size: int, first: int, last: int) -> Iterator[Hashable]:
    """Contents of blocks ``[first, last)`` of ``req`` (``last <= keyed_blocks(req, block_size)``): the
    block's token ids as a tuple, or ``('#', hash ids covering it, offset of its first token in the first
    of them)`` from the trace's prompt hashes."""
    bs = block_size
    if req.prompt_ids is not None:
        ids, n = req.prompt_ids, req.prompt_len
        for k in range(first, last):
            a, b = k * bs, (k + 1) * bs
            if b <= n:
                yield ids[a:b]
            else:  # reaches into the outputs
                out = req.output_ids
                yield ids[a:] + tuple(out[max(0, a - n):b - n]) if a < n else tuple(out[a - n:b - n])
        return
    hashes, hb = req.hash_ids, req.hash_block
    for k in range(first, last):
        a = k * bs
        j0, j1 = a // hb, (a + bs - 1) // hb
        yield (_HASH, hashes[j0], a - j0 * hb) if j0 == j1 else (_HASH, hashes[j0:j1 + 1], a - j0 * hb)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}  # request -> its named blocks (a live list, appended to)
        self.held: dict[int, int] = {}  # request -> blocks its table holds: named, and reserved (no id yet)
        self._reserved = 0  # reserved blocks of all tables: plain free blocks set aside (<= len(_free))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks no table holds, oldest first
        self._shared: dict[int, int] = {}  # block -> tables holding it beyond the first
        self._key: dict[int, tuple[tuple[int, Hashable], int]] = {}  # cached block -> (its key, its node)
        self._block: dict[tuple[int, Hashable], int] = {}  # (parent node, content) -> cached block
        self._nodes = 0  # node numbers handed out
        self._progress: dict[int, tuple[int, int]] = {}  # request -> (blocks looked at for caching, parent node)
        self.version = 0  # changes whenever the set of cached blocks does (lookups memoise on it)

    @property
    def num_free(self) -> int:
        """Blocks a request can get: never-cached ones and cached ones that no table holds, less those reserved."""
        return len(self._free) + len(self._lru) - self._reserved

    @property
    def num_reserved(self) -> int:
        """Blocks held by tables that have no id yet (named when their table is read)."""
        return self._reserved

    @property
    def num_cached(self) -> int:
        return len(self._key)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, req_id: int, num_tokens: int) -> int:
        """Blocks to add so that ``req_id`` holds ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - self.held.get(req_id, 0))

    def can_hold(self, req_id: int, num_tokens: int, reserve: int = 0) -> bool:
        return self.extra_blocks(req_id, num_tokens) + reserve <= self.num_free

    def freeable(self, req_ids: list[int]) -> int:
        """Blocks that dropping all of these tables would return to the pool (a block also held by another
        table stays; a reserved block is never shared)."""
        tables, held, shared = self.tables, self.held, self._shared
        if not shared:
            return sum(held[r] for r in req_ids)
        seen: dict[int, int] = {}
        for r in req_ids:
            for b in tables[r]:
                seen[b] = seen.get(b, 0) + 1
        owed = sum(held[r] - len(tables[r]) for r in req_ids)
        return owed + sum(1 for b, n in seen.items() if n > shared.get(b, 0))

    # ---- the prefix cache -------------------------------------------------------------------------
    def match(self, req: Request) -> list[int]:
        """Cached blocks holding the longest prefix of ``req``'s known tokens, in whole blocks and leaving at
        least one token to compute (the pass that samples needs one). Changes nothing."""
        if not self.prefix_caching or not self._block:
            return []
        bs = self.block_size
        n = min(keyed_blocks(req, bs), (req.known - 1) // bs)
        hits: list[int] = []
        parent, get, key_of = ROOT, self._block.get, self._key
        for content in block_keys(req, bs, 0, n):
            b = get((parent, content))
            if b is None:
                break
            hits.append(b)
            parent = key_of[b][1]
        return hits

    def hit_cost(self, hits: list[int]) -> int:
        """Free blocks that taking ``hits`` uses up (those no table holds now)."""
        lru = self._lru
        return sum(1 for b in hits if b in lru)

    def take(self, req_id: int, hits: list[int]) -> list[int]:
        """Start ``req_id``'s (empty) table with the cached blocks ``hits`` (from :meth:`match`)."""
        if self.held.get(req_id):
            raise KvCacheError(f"request {req_id} already holds blocks")
        lru, shared = self._lru, self._shared
        for b in hits:
            if b in lru:
                del lru[b]
            else:
                shared[b] = shared.get(b, 0) + 1
        table = self.tables[req_id] = list(hits)
        self.held[req_id] = len(hits)
        if self.prefix_caching:
            self._progress[req_id] = (len(hits), self._key[hits[-1]][1] if hits else ROOT)
        return table

    def commit(self, req: Request, num_tokens: int) -> None:
        """Cache ``req``'s full blocks among its first ``num_tokens`` tokens, whose KV is now written. A block
        whose key is already cached elsewhere (two requests computed the same prefix at once) stays private,
        and so does the rest of the request."""
        if not self.prefix_caching:
            return
        done, parent = self._progress.get(req.id, (0, ROOT))
        bs = self.block_size
        last = min(num_tokens // bs, keyed_blocks(req, bs))
        if done < 0 or last <= done:
            return
        table, index, key_of = self.table(req.id), self._block, self._key  # (its blocks named: ids go in the index)
        for k, content in enumerate(block_keys(req, bs, done, last), start=done):
            b, key = table[k], (parent, content)
            have = index.get(key)
            if have is None:
                index[key] = b
                key_of[b] = (key, self._nodes)
                parent = self._nodes
                self._nodes += 1
            elif have == b:
                parent = key_of[b][1]
            else:
                last, parent = -1, ROOT
                break
        self._progress[req.id] = (last, parent)
        self.version += 1

    def _evict(self, n: int) -> None:
        """Move ``n`` cached blocks, least recently freed first, from the LRU list to the free list."""
        lru, free, index, key_of = self._lru, self._free, self._block, self._key
        for _ in range(n):
            b, _ = lru.popitem(last=False)
            del index[key_of.pop(b)[0]]
            free.append(b)
        self.version += 1

    # ---- tables ------------------------------------------------------------------------------------
    def allocate(self, req_id: int, num_tokens: int) -> list[int]:
        """Grow ``req_id``'s table to hold ``num_tokens`` tokens, every block named; returns the table (a live
        list)."""
        held = self.held.get(req_id, 0)
        need = -(-num_tokens // self.block_size) - held
        if need > self.num_free:
            raise KvCacheError(f"request {req_id} needs {need} blocks, {self.num_free} free")
        if req_id not in self.tables:
            self.tables[req_id] = []
        if need > 0:
            self._set_aside(need)
            held += need
        self.held[req_id] = held
        return self.table(req_id)

    def table(self, req_id: int) -> list[int]:
        """``req_id``'s table with every block it holds named: its reserved blocks get ids now, from the top of
        the free stack (in pop order). The live list, appended to as the table grows."""
        table = self.tables[req_id]
        n = self.held[req_id] - len(table)
        if n > 0:
            free = self._free
            table.extend(free[:-n - 1:-1])  # the top n, in pop order
            del free[-n:]
            self._reserved -= n
        return table

    def named(self, req_ids: list[int]) -> list[list[int]]:
        """:meth:`table` of each of ``req_ids``, the call made only for a table with reserved blocks (a method call
        per table cost 60 ms of bullet's 5 s cProfiled simulation of 3,000 Azure conversation requests)."""
        tables, held, table = self.tables, self.held, self.table
        return [t if len(t) == held[i] else table(i) for i, t in zip(req_ids, map(tables.__getitem__, req_ids))]

    def _set_aside(self, n: int) -> None:
        """Reserve ``n`` more plain free blocks, evicting cached blocks no table holds when the plain ones run
        short (as handing them out at once would: the same evictions at the same time)."""
        self._reserved += n
        if self._reserved > len(self._free):
            self._evict(self._reserved - len(self._free))

    def grow(self, wants: list[tuple[int, int]], named: bool = False) -> None:
        """Make each of many existing tables hold its number of tokens (the fused-decode hot path), all or
        nothing. The new blocks are reserved, named when the table is read (:meth:`table`): the simulator never
        reads a decode launch's tables (naming a few tables' blocks at once instead cost static-split ~55M more
        instructions over 3,000 Azure conversation requests, 2,892M -> 2,946M). ``named``: name them now, for a
        caller whose chunks already hold the live lists (chunked prefill's mixed launches: naming them afterwards,
        a method call a table, cost chunked 78M instructions of 2,164M on the same requests)."""
        bs, held = self.block_size, self.held
        grown = []
        total = 0
        for rid, tokens in wants:
            want = -(-tokens // bs)
            n = want - held[rid]
            if n > 0:
                grown.append((rid, want))
                total += n
        if not total:
            return
        if total > self.num_free:
            raise KvCacheError(f"{len(wants)} requests need {total} blocks, {self.num_free} free")
        held.update(grown)
        self._set_aside(total)
        if named:  # (table() for each, inline)
            tables, free, taken = self.tables, self._free, 0
            for rid, want in grown:
                table = tables[rid]
                n = want - len(table)
                if n == 1:
                    table.append(free.pop())
                else:
                    table.extend(free[:-n - 1:-1])  # the top n, in pop order
                    del free[-n:]
                taken += n
            self._reserved -= taken

    def reserve(self, req_ids: list[int], blocks: list[int], added: int) -> None:
        """Make each table of ``req_ids`` hold ``blocks`` blocks (each at least what it holds), ``added`` more in
        all, all or nothing; reserved, named when read. One C-level update of ``held`` however many tables grow
        (what :meth:`grow` computes per table, a caller with arrays computes in a few vector operations)."""
        if added > self.num_free:
            raise KvCacheError(f"{len(req_ids)} requests need {added} blocks, {self.num_free} free")
        self.held.update(zip(req_ids, blocks))
        self._set_aside(added)

    def free(self, req_id: int) -> int:
        """Drop ``req_id``'s table (finish or preemption); returns how many blocks it held. Its cached blocks
        stay cached: tail blocks first into the LRU list, so that a prefix outlives its extensions; its
        reserved blocks go back unnamed."""
        table = self.tables.pop(req_id, None)
        held = self.held.pop(req_id, 0)
        if self._progress:
            self._progress.pop(req_id, None)
        if table is None:
            return 0
        self._reserved -= held - len(table)
        if not table:
            return held
        if not self._key and not self._shared:
            self._free.extend(reversed(table))
            return held
        shared, key_of, lru, free = self._shared, self._key, self._lru, self._free
        for b in reversed(table):
            n = shared.get(b)
            if n:
                if n == 1:
                    del shared[b]
                else:
                    shared[b] = n - 1
            elif b in key_of:
                lru[b] = None
            else:
                free.append(b)
        return held

    def check(self) -> None:
        """Invariants: every block is free (plain or cached-unheld) or named in a table, never both; a block's
        holders match its share count; the cache's two indexes and its parent links agree; every table holds
        at least its named blocks, and the reserved ones are plain free blocks set aside, counted once."""
        if self.held.keys() != self.tables.keys():
            raise KvCacheError(f"tables {sorted(self.tables)} but blocks held by {sorted(self.held)}")
        owed = [self.held[r] - len(t) for r, t in self.tables.items()]
        if any(n < 0 for n in owed):
            raise KvCacheError("a table names more blocks than it holds")
        if sum(owed) != self._reserved or not 0 <= self._reserved <= len(self._free):
            raise KvCacheError(f"{sum(owed)} blocks owed to tables but {self._reserved} reserved, of "
                               f"{len(self._free)} plain free blocks")
        holders: dict[int, int] = {}
        for t in self.tables.values():
            for b in t:
                holders[b] = holders.get(b, 0) + 1
        free, lru = self._free, self._lru
        every = list(holders) + free + list(lru)
        if len(every) != self.num_blocks or set(every) != set(range(self.num_blocks)):
            raise KvCacheError(f"block accounting broken: {len(holders)} held + {len(free)} free + {len(lru)} "
                               f"cached-free != {self.num_blocks}, or a block is both held and free")
        for b, n in holders.items():
            if self._shared.get(b, 0) != n - 1:
                raise KvCacheError(f"block {b} is in {n} tables but its share count is {self._shared.get(b, 0)}")
        if any(b not in holders for b in self._shared):
            raise KvCacheError("a block no table holds has a share count")
        if any(b not in self._key for b in lru) or any(b in self._key for b in free):
            raise KvCacheError("the LRU list holds an uncached block, or the free list a cached one")
        if len(self._block) != len(self._key) or any(self._block.get(k) != b for b, (k, _) in self._key.items()):
            raise KvCacheError("the cache's indexes disagree")
        nodes = [n for _, n in self._key.values()]
        if len(set(nodes)) != len(nodes) or any(not ROOT <= k[0] < self._nodes for k, _ in self._key.values()):
            raise KvCacheError("cache nodes are not unique, or a key hangs under a node never handed out")


def ideal_hit_tokens(requests: list[Request], block_size: int) -> tuple[int, int]:
    """Prompt tokens an infinite prefix cache would serve, and prompt tokens in all, over ``requests`` taken
    in arrival order (each prompt's blocks are cached once it has been seen; the same whole-block rule as
    :meth:`BlockManager.match`)."""
    order = sorted(requests, key=lambda r: (r.arrival, r.id))
    hbs = {r.hash_block for r in order if r.prompt_ids is None and r.hash_ids is not None}
    if len(hbs) == 1 and next(iter(hbs)) % block_size == 0 and all(r.prompt_ids is None for r in order):
        return _ideal_by_hash_block(order, block_size, hbs.pop())
    seen: dict[tuple[int, Hashable], int] = {}
    hit = total = 0
    for r in order:
        total += r.prompt_len
        n = keyed_blocks(r, block_size)
        cap = min(n, (r.prompt_len - 1) // block_size)
        parent, matched = ROOT, True
        for k, content in enumerate(block_keys(r, block_size, 0, n)):
            key = (parent, content)
            node = seen.get(key)
            if node is None:
                node = seen[key] = len(seen)
                matched = False
            elif matched and k < cap:
                hit += block_size
            parent = node
    return hit, total


def _ideal_by_hash_block(order: list[Request], block_size: int, hash_block: int) -> tuple[int, int]:
    """:func:`ideal_hit_tokens` for trace hashes whose blocks hold whole KV blocks, one hash id at a time:
    a KV block is cached under its hash chain and offset, and the offsets seen under a chain always run from
    0, so each chain needs only how many of its KV blocks some prompt covered."""
    per = hash_block // block_size
    nodes: dict[tuple[int, int], list[int]] = {}  # (parent node, hash id) -> [node, KV blocks covered]
    hit = total = 0
    for r in order:
        total += r.prompt_len
        full = r.prompt_len // block_size
        parent, matched, got = ROOT, True, 0
        for j, hid in enumerate(r.hash_ids or ()):
            mine = min(per, full - j * per)  # this prompt's full KV blocks under hash block j
            if mine <= 0:
                break
            entry = nodes.get((parent, hid))
            if entry is None:
                entry = nodes[(parent, hid)] = [len(nodes), 0]
            if matched:
                got += min(entry[1], mine)
                matched = entry[1] >= mine
            entry[1] = max(entry[1], mine)
            parent = entry[0]
        hit += min(got, (r.prompt_len - 1) // block_size) * block_size
    return hit, total


__all__ = ["ROOT", "BlockManager", "KvCacheError", "block_keys", "ideal_hit_tokens", "keyed_blocks"]
