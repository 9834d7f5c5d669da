"""A request and the one number that says where it is: ``num_computed``, tokens whose KV is cached."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = True  # benchmarks generate exactly max_new_tokens

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("SamplingParams: temperature must be >= 0 and top_p in (0, 1]")


GREEDY = SamplingParams()


@dataclass(slots=True, eq=False)
class Request:
    """One request. Phase is implied: the next forward pass covers positions ``[num_computed, known)``
    where ``known = prompt_len + num_output``; it samples a token when it reaches ``known``.

    ``token_times`` holds the completion time of each output token when the scheduler keeps them
    (``Scheduler.keep_token_times``: live serving and tests do; a simulation does only when asked, so that
    its memory does not grow with output tokens); ``first_token_time`` and ``last_token_time`` are always
    kept. ``hash_ids`` names the prompt's blocks
    of ``hash_block`` tokens as a trace gives them (Mooncake): two requests whose leading ids agree share that
    prefix; the prefix cache keys blocks by these when ``prompt_ids`` is absent."""

    id: int
    arrival: float
    prompt_len: int
    max_new_tokens: int
    prompt_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    hash_block: int = 512
    sampling: SamplingParams = GREEDY
    num_computed: int = 0
    num_output: int = 0
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when first admitted
    error: str | None = None  # why the request was rejected unserved (too long for the model or the cache)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.max_new_tokens < 1:
            raise ValueError(f"request {self.id}: prompt_len and max_new_tokens must be >= 1")
        if self.prompt_ids is not None and len(self.prompt_ids) != self.prompt_len:
            raise ValueError(f"request {self.id}: {len(self.prompt_ids)} prompt ids but prompt_len "
                             f"{self.prompt_len}")
        if self.hash_ids is not None:
            if self.hash_block < 1:
                raise ValueError(f"request {self.id}: hash_block must be >= 1, got {self.hash_block}")
            need = -(-self.prompt_len // self.hash_block)
            if len(self.hash_ids) != need:
                raise ValueError(f"request {self.id}: {len(self.hash_ids)} hash ids, but a {self.prompt_len}-token "
                                 f"prompt has {need} blocks of {self.hash_block} tokens")

    @property
    def known(self) -> int:
        """Tokens whose ids exist: the prompt and every output so far."""
        return self.prompt_len + self.num_output

    @property
    def remaining(self) -> int:
        """Positions still to compute before the next token can be sampled."""
        return self.known - self.num_computed
