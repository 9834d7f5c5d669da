"""The contract between a policy and an executor: what to run where, and what came back."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Literal, NamedTuple, Protocol

import numpy as np

from .config import PartitionError, check_corun
from .request import GREEDY, SamplingParams

Lane = Literal["prefill", "decode", "all"]


@dataclass(frozen=True, slots=True)
class Partition:
    """An SM budget; the GPU executor maps it to a pre-created green-context stream."""

    lane: Lane
    num_sms: int


class Chunk(NamedTuple):
    """Positions ``[start, start + num_tokens)`` of one request. A NamedTuple: cheap on the hot path."""

    req_id: int
    start: int  # == the request's num_computed when scheduled
    num_tokens: int  # 1 for a decode step
    block_ids: Sequence[int]  # the request's block table at launch (read at launch, not kept)
    sample: bool  # the chunk reaches the request's last known token: a token is sampled
    token_ids: Sequence[int] | None = None  # input ids where the host has them (None: executor-side)
    sampling: SamplingParams = GREEDY


_SAMPLE = attrgetter("sample")  # (a C-level test per chunk: every fused launch checks its chunks)


class DecodeChunks(Sequence[Chunk]):
    """A decode launch's chunks, one decode step of each request: ``Chunk(r.id, start, 1, table, True, None,
    r.sampling)`` for each request ``r`` of ``reqs`` with its ``starts`` and its block table in ``kv`` (the block
    manager's live list, every block named: :meth:`~bullet.kvcache.BlockManager.table`), made when first read. The
    simulator reads only their number (the policy gives it the launch's Work), and a Chunk apiece cost ~2,400
    instructions: 6 % of a static-split simulation (bench/RESULTS.md, fourteenth speed pass); naming the blocks a
    fused stretch reserved cost half of a bullet decode decision (issue 10). An executor reads them at launch; a
    request whose KV was freed before they are first read (an update streamed after its end) gets no block ids.
    With ``ids``, ``starts`` are the starts of the requests ``ids`` names, both arrays in any order (a policy's
    decode arrays, taken in slot order), paired with ``reqs`` when first read: no pass over the requests until then.
    Equal to, and hashed as, the tuple of those chunks; every chunk samples."""

    __slots__ = ("_ids", "_kv", "_made", "_reqs", "_starts")

    def __init__(self, reqs: Sequence, starts: Sequence[int], kv, ids=None) -> None:
        self._reqs, self._starts, self._kv, self._ids, self._made = reqs, starts, kv, ids, None

    def _tuple(self) -> tuple[Chunk, ...]:
        if self._made is None:
            starts = self._starts
            if self._ids is not None:
                by_id = dict(zip(self._ids.tolist(), starts.tolist()))
                starts = [by_id[r.id] for r in self._reqs]
            new, kv = tuple.__new__, self._kv  # (as Scheduler._decode_chunks makes them)
            ids = [r.id for r in self._reqs]
            tables = kv.named(ids) if all(map(kv.tables.__contains__, ids)) else \
                [kv.table(i) if i in kv.tables else () for i in ids]
            self._made = tuple([new(Chunk, (r.id, s, 1, t, True, None, r.sampling))
                                for r, s, t in zip(self._reqs, starts, tables)])
        return self._made

    def __len__(self) -> int:
        return len(self._reqs)

    def __getitem__(self, i):
        return self._tuple()[i]

    def __iter__(self):
        return iter(self._tuple())

    def __eq__(self, other) -> bool:
        return self._tuple() == (other._tuple() if type(other) is DecodeChunks else other)

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __repr__(self) -> str:
        return f"DecodeChunks{self._tuple()!r}"


def all_sample(chunks: Sequence[Chunk]) -> bool:
    """Every chunk samples (a DecodeChunks' do, unread)."""
    return type(chunks) is DecodeChunks or all(map(_SAMPLE, chunks))


def chunk_tokens(chunks: Sequence[Chunk]) -> int:
    """Tokens of ``chunks`` (a DecodeChunks' one each, unread)."""
    return len(chunks) if type(chunks) is DecodeChunks else sum(map(_NUM_TOKENS, chunks))


_NUM_TOKENS = itemgetter(2)  # Chunk.num_tokens


@dataclass(frozen=True, slots=True, init=False)
class Batch:
    """One launch on one lane. ``steps > 1`` fuses steps: the chunks as given, then ``steps - 1`` decode
    steps of every chunk, each feeding the token the step before sampled (so every chunk must sample and
    the launch covers all layers). Policies size it to end at the next scheduling event."""

    partition: Partition
    layers: range  # all layers, or a slice: layer-granular prefill
    chunks: tuple[Chunk, ...] | DecodeChunks  # (DecodeChunks: a decode launch's, made when read)
    steps: int = 1  # sampling happens in the launch whose layer slice reaches the last layer
    cached_tokens: int = 0  # prompt tokens of requests first admitted into this launch that hit the prefix cache

    def __init__(self, partition: Partition, layers: range, chunks: tuple[Chunk, ...], steps: int = 1,
                 cached_tokens: int = 0) -> None:
        # A launch is made on every scheduling decision: the fields are set through their slots (a frozen
        # dataclass's generated __init__ goes through object.__setattr__ per field, ~2.5x the cost)
        if steps > 1 and type(chunks) is not DecodeChunks and not all(map(_SAMPLE, chunks)):  # (all_sample inline)
            raise ValueError("a fused multi-step batch needs every chunk to sample")
        _SET_PARTITION(self, partition)
        _SET_LAYERS(self, layers)
        _SET_CHUNKS(self, chunks)
        _SET_STEPS(self, steps)
        _SET_CACHED(self, cached_tokens)

    @property
    def num_tokens(self) -> int:
        return chunk_tokens(self.chunks)

    @property
    def lane(self) -> Lane:
        return self.partition.lane


_SET_PARTITION, _SET_LAYERS, _SET_CHUNKS, _SET_STEPS, _SET_CACHED = (
    getattr(Batch, f).__set__ for f in ("partition", "layers", "chunks", "steps", "cached_tokens"))


class StepResult(NamedTuple):
    """What came back from one launch. A NamedTuple: one is made per launch."""

    batch: Batch
    start: float
    end: float
    step_ends: Sequence[float]  # end of each fused step (len == batch.steps; last == end)
    tokens: np.ndarray | None  # (steps, chunks) sampled ids, -1 where none; None: lengths only (simulator)


class Executor(Protocol):
    def now(self) -> float:
        """Seconds, wall or virtual."""

    def launch(self, batch: Batch) -> None:
        """Non-blocking; at most one batch in flight per lane, and (async scheduling) one queued behind it,
        which starts when that one ends."""

    def wait(self, until: float | None) -> list[StepResult]:
        """Finished steps (in end order); [] once ``until`` passes with nothing finished."""

    def busy(self, lane: Lane) -> bool:
        """A batch is in flight on ``lane``."""

    def queued(self, lane: Lane) -> bool:
        """A batch waits behind the one in flight on ``lane`` (async scheduling)."""

    def release(self, req_id: int) -> None:
        """Forget request ``req_id``: it ended (finished, rejected or aborted) and is in no launch."""


def check_launch(batch: Batch, running: Iterable[Batch], sizes: Mapping[Lane, Collection[int]], num_sms: int) -> None:
    """The partition rule both executors enforce before a launch (PartitionError otherwise): ``batch`` asks
    for a size its lane's menu has (``sizes``), exactly; lane "all" runs alone; a prefill and a decode
    launch in flight together are disjoint (:func:`~bullet.config.check_corun`)."""
    part = batch.partition
    if part.num_sms not in sizes[part.lane]:
        raise PartitionError(f"no {part.lane} partition of {part.num_sms} SMs: the menu has "
                             f"{', '.join(map(str, sizes[part.lane]))}")
    for other in running:
        o = other.partition
        if "all" in (part.lane, o.lane):
            raise PartitionError(f"a {part.lane} launch cannot run next to a {o.lane} launch: lane 'all' "
                                 "holds the whole GPU")
        pre, dec = (part, o) if part.lane == "prefill" else (o, part)
        check_corun(pre.num_sms, dec.num_sms, num_sms)
