"""The block manager under random allocate / append / free / preempt sequences (property-based)."""

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
            assert rid not in self.kv.tables or not self.kv.tables[rid]
            self.kv.tables.pop(rid, None)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.integers(1, 40))
    def append(self, data, more):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        want = self.tokens[rid] + more
        before = list(self.kv.tables[rid])
        if self.kv.can_hold(rid, want):
            table = self.kv.allocate(rid, want)
            assert table[:len(before)] == before  # growing never moves existing blocks
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
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        # finishing and preempting both return every block; a preempted request later allocates anew
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.kv.tables[rid])
        assert self.kv.free(rid) == n
        held = self.tokens.pop(rid)
        if preempt and self.kv.can_hold(rid, held):
            self.kv.allocate(rid, held)
            self.tokens[rid] = held

    @invariant()
    def accounting(self):
        self.kv.check()
        assert self.kv.num_free == 64 - sum(len(t) for t in self.kv.tables.values())
        for rid, n in self.tokens.items():
            assert len(self.kv.tables[rid]) == -(-n // 16)


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
    with pytest.raises(KvCacheError):
        kv.check()
