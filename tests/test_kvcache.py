"""The block manager under random allocate / append / free / preempt sequences (property-based)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bullet.kvcache import BlockManager, KvCacheError


class KvMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = BlockManager(num_blocks=64, block_size=16)
        self.tokens: dict[int, int] = {}  # what each request holds, by our own count
        self.next_id = 0

    @rule(n=st.integers(1, 400))
    def allocate_new(self, n):
        rid, self.next_id = self.next_id, self.next_id + 1
        if self.kv.can_hold(rid, n):
            table = self.kv.allocate(rid, n)
            assert len(table) == -(-n // 16)
            self.tokens[rid] = n
        else:
            with pytest.raises(KvCacheError):
                self.kv.allocate(rid, n)
            assert rid not in self.kv.tables and rid not in self.kv.held

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.integers(1, 40))
    def append(self, data, more):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        want = self.tokens[rid] + more
        before = list(self.kv.tables[rid])
        if self.kv.can_hold(rid, want):
            table = self.kv.allocate(rid, want)  # (names every block it holds, reserved ones included)
            assert table[:len(before)] == before  # growing never moves existing blocks
            assert len(table) == self.kv.held[rid] == -(-want // 16)
            self.tokens[rid] = want
        else:
            with pytest.raises(KvCacheError):
                self.kv.allocate(rid, want)
            assert self.kv.tables[rid] == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def grow_many(self, data):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=5, unique=True))
        wants = [(rid, self.tokens[rid] + 17) for rid in rids]
        need = sum(self.kv.extra_blocks(rid, t) for rid, t in wants)
        if need <= self.kv.num_free:
            self.kv.grow(wants)
            self.tokens.update(wants)
        else:
            with pytest.raises(KvCacheError):
                self.kv.grow(wants)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def reserve_many(self, data):
        # the lazy path (a fused stretch over many tables): blocks reserved, no ids yet
        rids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=5, unique=True))
        wants = {rid: self.tokens[rid] + 17 for rid in rids}
        blocks = [-(-wants[rid] // 16) for rid in rids]
        added = sum(b - self.kv.held[rid] for rid, b in zip(rids, blocks))
        if added <= self.kv.num_free:
            self.kv.reserve(rids, blocks, added)
            self.tokens.update(wants)
        else:
            with pytest.raises(KvCacheError):
                self.kv.reserve(rids, blocks, added)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def read(self, data):
        # a table read names its reserved blocks: as long as what it holds, the named ones kept, no id twice
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        before, free = list(self.kv.tables[rid]), self.kv.num_free
        table = self.kv.table(rid)
        assert table[:len(before)] == before and len(table) == -(-self.tokens[rid] // 16)
        assert self.kv.num_free == free  # reserved blocks were already off the pool

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        # finishing and preempting both return every block; a preempted request later allocates anew
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        n = self.kv.held[rid]
        assert self.kv.free(rid) == n
        held = self.tokens.pop(rid)
        if preempt and self.kv.can_hold(rid, held):
            self.kv.allocate(rid, held)
            self.tokens[rid] = held

    @invariant()
    def accounting(self):
        self.kv.check()
        assert self.kv.num_free == 64 - sum(self.kv.held.values())
        named = [b for t in self.kv.tables.values() for b in t]
        assert len(set(named)) == len(named)
        for rid, n in self.tokens.items():
            assert self.kv.held[rid] == -(-n // 16) >= len(self.kv.tables[rid])


TestKvMachine = KvMachine.TestCase
TestKvMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(1, 100), max_size=20))
def test_free_returns_everything(sizes):
    kv = BlockManager(200, 8)
    for i, n in enumerate(sizes):
        if kv.can_hold(i, n):
            kv.allocate(i, n)
    for i in list(kv.tables):
        kv.free(i)
    assert kv.num_free == 200
    kv.check()


def test_check_detects_double_ownership():
    kv = BlockManager(4, 16)
    kv.allocate(0, 16)
    kv.tables[1] = list(kv.tables[0])
    kv.held[1] = 1
    with pytest.raises(KvCacheError):
        kv.check()


def test_grow_reserves_and_a_read_names():
    # 10 blocks of 4 tokens; A holds 5 tokens (2 blocks), B 4 (1): growing A to 13 tokens (4 blocks) and B to 9
    # (3) reserves 2 + 2 blocks without naming any; the pool then has 10 - 3 - 4 = 3 free
    kv = BlockManager(10, 4)
    a, b = list(kv.allocate(0, 5)), list(kv.allocate(1, 4))
    assert a == [0, 1] and b == [2]
    kv.reserve([0, 1], [4, 3], 4)
    assert kv.held == {0: 4, 1: 3} and kv.tables == {0: [0, 1], 1: [2]} and kv.num_free == 3
    kv.check()
    # A read names A's two: the next ids off the free stack, after its own
    assert kv.table(0) == [0, 1, 3, 4] and kv.num_free == 3
    kv.check()
    # B freed with its 2 still unnamed: all 3 of its blocks come back (free returns what it held)
    assert kv.free(1) == 3 and kv.num_free == 6 and 1 not in kv.held
    kv.check()
    # a reservation beyond the pool fails and changes nothing
    with pytest.raises(KvCacheError):
        kv.reserve([0], [11], 7)
    assert kv.held == {0: 4} and kv.num_free == 6
    kv.reserve([0], [10], 6)
    assert kv.num_free == 0 and len(set(kv.table(0))) == 10
    kv.check()


def test_grow_reserves_for_many_tables():
    # 8 tables of 1 block (4 tokens) in a pool of 40: growing all 8 to 3 blocks reserves 8 x 2 = 16 and names
    # none; read, they hold the 24 lowest ids
    kv = BlockManager(40, 4)
    for i in range(8):
        kv.allocate(i, 4)
    kv.grow([(i, 12) for i in range(8)])
    assert all(kv.held[i] == 3 and len(kv.tables[i]) == 1 for i in range(8)) and kv.num_free == 16
    kv.check()
    assert sorted(b for i in range(8) for b in kv.table(i)) == list(range(24))
    kv.check()


def test_check_catches_a_broken_reservation():
    kv = BlockManager(8, 4)
    kv.allocate(0, 4)
    kv.reserve([0], [3], 2)
    kv._reserved -= 1  # a reserved block counted free again
    with pytest.raises(KvCacheError, match="owed"):
        kv.check()
    kv._reserved += 1
    kv.held[0] = 0  # holding fewer blocks than it names
    with pytest.raises(KvCacheError, match="names more"):
        kv.check()
    kv.held[0] = 3
    kv._reserved = 2
    kv._free[:] = kv._free[:1]  # more reserved than plain free blocks
    with pytest.raises(KvCacheError):
        kv.check()


def test_reserved_blocks_evict_the_cache_when_the_plain_ones_run_short():
    # 4 blocks of 2 tokens, prefix caching on: A computes 4 tokens (2 cached blocks) and finishes, so they wait
    # in the LRU list; B holds the 2 plain blocks, and growing it by 1 must evict A's older block at once, as
    # handing the block out would: the cache then holds 1 block, and the pool 1 free
    kv = BlockManager(4, 2, prefix_caching=True)
    ra = Request(0, 0.0, 4, 1, prompt_ids=(1, 2, 3, 4))
    kv.allocate(0, 4)
    kv.commit(ra, 4)
    kv.free(0)
    assert kv.num_cached == 2 and kv.num_free == 4
    kv.allocate(1, 4)
    assert kv.num_free == 2 and kv.num_cached == 2
    kv.reserve([1], [3], 1)
    assert kv.num_cached == 1 and kv.num_free == 1 and len(kv.tables[1]) == 2
    kv.check()
    assert len(set(kv.table(1))) == 3
    kv.check()


# ---------------------------------------------------------------------------------------------- prefix cache

from bullet.request import Request

BS = 4


def req(rid, ids, hash_ids=None, hash_block=8, n=None):
    return Request(rid, 0.0, n or len(ids), 1, prompt_ids=None if hash_ids else tuple(ids),
                   hash_ids=hash_ids, hash_block=hash_block)


def compute(kv, r, tokens):
    """Pretend the request's KV up to ``tokens`` is written, and cache its full blocks."""
    r.num_computed = tokens
    kv.commit(r, tokens)


class PrefixMachine(RuleBasedStateMachine):
    """Random admissions of prompts drawn from a few shared prefixes, partial computes, frees, in a small pool
    (so cached blocks get evicted). A model of the pool's contents (which prompt prefix each block's KV was
    computed for) checks every hit: a hit block always holds exactly the asking prompt's prefix."""

    def __init__(self):
        super().__init__()
        self.kv = BlockManager(num_blocks=40, block_size=BS, prefix_caching=True)
        rng = np.random.default_rng(0)
        self.bases = [tuple(int(x) for x in rng.integers(0, 50, 40)) for _ in range(3)]
        self.content: dict[int, tuple | None] = {}  # block -> the token prefix its KV was computed for
        self.held: dict[int, Request] = {}
        self.next_id = 0

    @rule(family=st.integers(0, 2), cut=st.integers(0, 40), tail=st.lists(st.integers(0, 60), max_size=12))
    def admit(self, family, cut, tail):
        ids = self.bases[family][:cut] + tuple(tail)
        if not ids:
            return
        r = req(self.next_id, ids)
        self.next_id += 1
        hits = self.kv.match(r)
        assert len(hits) * BS <= len(ids) - 1  # at least one token is left to compute
        for k, b in enumerate(hits):
            assert self.content.get(b) == ids[:(k + 1) * BS], "a hit returned another prompt's KV"
        need = self.kv.blocks_for(len(ids)) - len(hits) + self.kv.hit_cost(hits)
        if need > self.kv.num_free:
            return
        self.kv.take(r.id, hits)
        table = self.kv.allocate(r.id, len(ids))
        for b in table[len(hits):]:
            self.content[b] = None  # fresh block: garbage until computed
        r.num_computed = len(hits) * BS
        self.held[r.id] = r

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def compute_some(self, data):
        r = data.draw(st.sampled_from(sorted(self.held.values(), key=lambda r: r.id)))
        upto = data.draw(st.integers(r.num_computed, r.prompt_len))
        table = self.kv.tables[r.id]
        for k in range(r.num_computed // BS, upto // BS):
            self.content[table[k]] = r.prompt_ids[:(k + 1) * BS]
        compute(self.kv, r, upto)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.held)))
        n = len(self.kv.tables[rid])
        assert self.kv.free(rid) == n
        del self.held[rid]

    @invariant()
    def accounting(self):
        self.kv.check()
        held = {b for t in self.kv.tables.values() for b in t}
        assert self.kv.num_free == 40 - len(held)


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_hits_are_whole_blocks_of_the_longest_cached_prefix():
    kv = BlockManager(64, BS, prefix_caching=True)
    a = req(0, range(20))
    kv.allocate(0, 20)
    compute(kv, a, 20)  # 5 full blocks cached
    assert kv.num_cached == 5
    assert kv.match(req(1, [*range(10), 99])) == kv.tables[0][:2]  # 10 shared tokens: 2 whole blocks
    assert kv.match(req(2, range(20))) == kv.tables[0][:4]  # all 20 shared: the last block is recomputed
    assert kv.match(req(3, range(21))) == kv.tables[0][:5]
    assert kv.match(req(4, [1, *range(1, 20)])) == []  # differs in the first token
    assert kv.match(req(5, range(3))) == []  # shorter than a block


def test_lru_evicts_the_oldest_and_tails_first_and_only_when_needed():
    """8 blocks. A (16 tokens, 4 blocks) is cached and freed: its blocks wait in the LRU list, tail first.
    B takes 2 of the 4 never-used blocks: nothing evicted. C needs 4 blocks: the 2 plain ones, then the 2
    oldest cached, which are A's last two blocks; A's first two survive."""
    kv = BlockManager(8, BS, prefix_caching=True)
    a = req(0, range(16))
    kv.allocate(0, 16)
    compute(kv, a, 16)
    a_blocks = list(kv.tables[0])
    kv.free(0)
    assert kv.num_free == 8 and kv.num_cached == 4
    kv.allocate(1, 8)
    assert kv.num_cached == 4 and not set(kv.tables[1]) & set(a_blocks)
    kv.allocate(2, 16)
    assert set(kv.tables[2]) & set(a_blocks) == set(a_blocks[2:])
    assert kv.match(req(3, range(17))) == a_blocks[:2]
    kv.check()


def test_shared_blocks_are_counted_once_and_freed_by_the_last_holder():
    kv = BlockManager(16, BS, prefix_caching=True)
    a = req(0, range(12))
    kv.allocate(0, 12)
    compute(kv, a, 12)
    b = req(1, [*range(8), 50, 51, 52, 53, 54])
    hits = kv.match(b)
    assert hits == kv.tables[0][:2] and kv.hit_cost(hits) == 0  # held by A: taking them costs nothing
    kv.take(1, hits)
    kv.allocate(1, 13)
    assert kv.num_free == 16 - 3 - 2  # A's 3 blocks and B's 2 own ones; the shared 2 counted once
    assert kv.freeable([1]) == 2 and kv.freeable([0]) == 1 and kv.freeable([0, 1]) == 5
    kv.free(0)
    assert kv.num_free == 16 - 4  # A's third block is cached-free; the shared two stay with B
    kv.check()
    kv.free(1)
    assert kv.num_free == 16 and kv.num_cached == 3  # B's own blocks were never computed: not cached
    kv.check()


def test_equal_python_hashes_never_share_kv():
    """Python hashes ints modulo 2**61 - 1, so these two token blocks hash alike; their KV must not be
    shared. (Real token ids are small; the point is that a key is compared, not only hashed.)"""
    p = 2**61 - 1
    x, y = (5, 7, 9, 11), (5 + p, 7, 9, 11)
    assert hash(x) == hash(y) and x != y
    kv = BlockManager(8, BS, prefix_caching=True)
    kv.allocate(0, 8)
    compute(kv, req(0, [*x, 1, 2, 3, 4]), 8)
    assert kv.match(req(1, [*y, 1, 2, 3, 4, 5])) == []
    assert len(kv.match(req(2, [*x, 1, 2, 3, 4, 5]))) == 2


def test_trace_hashes_key_blocks():
    """Blocks of 4 under hashes of 8 tokens: a shared first hash id shares the first two KV blocks."""
    kv = BlockManager(16, BS, prefix_caching=True)
    a = req(0, None, hash_ids=(1, 2), n=16)
    kv.allocate(0, 16)
    compute(kv, a, 16)
    assert kv.num_cached == 4
    assert kv.match(req(1, None, hash_ids=(1, 3), n=16)) == kv.tables[0][:2]
    assert kv.match(req(2, None, hash_ids=(1, 2, 7), n=20)) == kv.tables[0][:4]
    assert kv.match(req(3, None, hash_ids=(4, 2), n=16)) == []
    # a prompt given as token ids never matches hash keys, whatever its ids
    assert kv.match(req(4, range(16))) == []


def test_prefix_caching_off_caches_nothing():
    kv = BlockManager(8, BS)
    kv.allocate(0, 16)
    compute(kv, req(0, range(16)), 16)
    assert kv.num_cached == 0 and kv.match(req(1, range(17))) == []
