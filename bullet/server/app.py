"""The OpenAI-compatible HTTP front end (vLLM's routes and shapes) over an :class:`~bullet.engine.Engine`
running in its own thread (:class:`~bullet.server.runner.EngineRunner`).

Each accepted request gets an id, a queue on the event loop and one :class:`Generation`, which turns the
engine's updates into text (incremental detokenization, stop strings, stop token ids) and ends exactly once:
finished by the engine, stopped here (the engine is then told to abort it), or aborted because the client went
away (a stream's disconnect is watched while it waits for tokens; so is a plain request's). The engine frees the
request's KV when its abort takes effect (at once, or when the launch it is inside returns).

Limits: ``max_num_seqs + max_waiting`` requests may be outstanding (accepted and not yet ended in the engine);
over that a request gets 429 with Retry-After, and 503 once shutdown has begun. A prompt that cannot fit the
model's context or the whole KV cache gets 400 naming the limit; malformed bodies 400 naming the field; an
unknown model 404; a missing or wrong API key (when one is set) 401 on ``/v1/*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..engine import Engine, Update
from ..request import Request, SamplingParams
from .metrics import ServerMetrics
from .protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from .runner import EngineDead, EngineRunner
from .tokenizer import Detokenizer, TokenizeError, Tokenizer

log = logging.getLogger("bullet.server")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class Refused(Exception):
    """Answer with this status and message (an error status for the client)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


@dataclass(frozen=True, slots=True)
class Piece:
    """What a generation hands to its response: new text (and ids), and at the end why it finished."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None
    error: str | None = None  # the engine could not serve it (or aborted it itself)


class Generation:
    """One accepted request, seen from the event loop."""

    def __init__(self, server: BulletServer, req: Request, stops: list[str], stop_ids: frozenset[int]) -> None:
        self.server, self.req = server, req
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.detok = Detokenizer(server.tokenizer, req.prompt_ids)
        self.stops, self.stop_ids = stops, stop_ids
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars held back while a stop may be forming
        self.pending = ""
        self.num_output = 0
        self.ended = False  # the engine reported its end (or was told to abort it)
        self.finished = False

    async def pieces(self) -> AsyncIterator[Piece]:
        while not self.finished:
            piece = self._apply(await self.queue.get())
            if piece is not None:
                yield piece

    def _apply(self, u: Update) -> Piece | None:
        eos = self.server.tokenizer.eos_token_id
        ids: list[int] = []
        reason: str | None = None
        stop: str | int | None = None
        for t in u.token_ids:
            self.num_output += 1
            if t in self.stop_ids:
                reason, stop = "stop", (None if t == eos else t)
                break
            ids.append(t)
            if self.stops:
                self.pending += self.detok.push((t,))
                found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
                if found:
                    i, s = min(found)
                    self.pending = self.pending[:i]
                    reason, stop = "stop", s
                    break
        final = u.finished or reason is not None
        if not self.stops:
            self.pending += self.detok.push(ids, final=final)
        elif final and not isinstance(stop, str):  # not cut at a stop string: flush what the detokenizer holds
            self.pending += self.detok.push((), final=True)
        error = None
        if reason is None and u.finished:
            reason = {"stop": "stop", "length": "length"}.get(u.reason, "abort")
            if u.reason in ("abort", "error"):
                error = u.request.error
        if u.finished:
            self.ended = True
        if reason is not None:
            self.finished = True
            text, self.pending = self.pending, ""
            if not self.ended:  # stopped here: the engine may still be generating it
                self.server.runner.abort(self.req.id)
                self.ended = True
                self.server.stopped_here(self.req, u.token_times[-1] if u.token_times else None)
        else:
            cut = max(0, len(self.pending) - self.hold)
            text, self.pending = self.pending[:cut], self.pending[cut:]
        if not text and not ids and reason is None:
            return None
        return Piece(text, tuple(ids), reason, stop, error)

    def close(self) -> None:
        """The response is over (sent, or its client went away): stop the engine's work on it."""
        if not self.ended:
            self.ended = True
            self.server.runner.abort(self.req.id)
        self.server.streams.pop(self.req.id, None)

    def usage(self) -> dict:
        p = self.req.prompt_len
        return {"prompt_tokens": p, "completion_tokens": self.num_output, "total_tokens": p + self.num_output}


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(Response):
    """``text/event-stream`` from an async iterator of ``data:`` payloads; when the client goes away the
    iterator is cancelled and ``on_close`` runs (it runs at the end in any case)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        # not Response.__init__: it would add "content-length: 0"
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data in self.events:
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(_until_disconnect(receive))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            self.on_close()
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):  # a bug, not the client
            log.error("a stream failed", exc_info=results[0])


class ApiKey:
    """ASGI middleware: ``/v1/*`` needs ``Authorization: Bearer <key>`` (401 otherwise), as in vLLM."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "a valid API key is needed: Authorization: Bearer <key>")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BulletServer:
    """The FastAPI app (``.app``) around an engine; ``runner`` owns the engine thread."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: ServerMetrics, *, model_name: str,
                 max_waiting: int = 512, api_key: str | None = None, window_s: float = 0.01,
                 thread_init: Callable[[], None] | None = None) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.model_name, self.api_key = model_name, api_key
        sched = engine.scheduler
        self.max_model_len = sched.model.max_position
        self.kv_tokens = sched.kv.num_blocks * sched.kv.block_size
        self.capacity = sched.cfg.max_num_seqs + max_waiting
        self.runner = EngineRunner(engine, self._deliver, window_s=window_s, after_step=metrics.after_step,
                                   thread_init=thread_init, on_take=metrics.taken)
        self.streams: dict[int, Generation] = {}
        self.outstanding = 0  # accepted and not yet ended in the engine
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._last_token: dict[int, float] = {}  # request id -> time of its last token (ITL)
        self._counted: set[int] = set()  # ended here (stop string / id); the engine's end is not counted again
        self.app = self._make_app()

    # ---- the engine thread's output, onto the event loop -------------------------------------------
    def _deliver(self, updates: list[Update]) -> None:
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._dispatch, updates)

    def _dispatch(self, updates: list[Update]) -> None:
        m, seen = self.metrics, self._last_token
        first: list[Update] = []
        rest: list[Update] = []
        for u in updates:
            (first if u.token_times and u.request.id not in seen else rest).append(u)
        if first and rest:  # first tokens first: their streams wake before the others' (each woken stream
            # costs the event loop tens of us; a first token behind ~60 streams of a step waited 2.8 ms to
            # become a chunk on this project's VM: python3 bench/http_path.py, bench/RESULTS.md)
            updates = first + rest
        for u in updates:
            req, rid = u.request, u.request.id
            if u.token_times:
                last = self._last_token.get(rid)
                if last is None:
                    m.first_token(u.token_times[0] - req.arrival, self.engine.executor.now() - u.token_times[0])
                m.tokens(u.token_times, last)
                self._last_token[rid] = u.token_times[-1]
            if u.finished:
                self.outstanding -= 1
                self._last_token.pop(rid, None)
                if rid in self._counted:  # a stop string or stop id ended it here: counted then
                    self._counted.discard(rid)
                else:
                    served = u.reason in ("stop", "length")
                    m.finished(u.reason, req.prompt_len, req.token_times[-1] - req.arrival if served else None)
            gen = self.streams.get(rid)
            if gen is not None:
                gen.queue.put_nowait(u)

    def stopped_here(self, req: Request, last: float | None) -> None:
        """A stop string or stop id ended ``req`` (the engine is told to abort it): count it as "stop"."""
        self._counted.add(req.id)
        self.metrics.finished("stop", req.prompt_len, None if last is None else last - req.arrival)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests (503) and let the engine finish the others within ``timeout`` seconds."""
        self.closing = True
        self.runner.close(timeout)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.loop = asyncio.get_running_loop()
        await self.loop.run_in_executor(None, self.runner.start)  # the engine thread warms up first
        try:
            yield
        finally:
            self.begin_shutdown(0.0)  # no-op if a signal began it already (the first deadline stands)
            await self.loop.run_in_executor(None, self.runner.join)

    # ---- the app ------------------------------------------------------------------------------------
    def _make_app(self) -> FastAPI:
        app = FastAPI(title="bullet", version=__version__, lifespan=self.lifespan, docs_url=None, redoc_url=None)

        if self.api_key is not None:
            app.add_middleware(ApiKey, key=self.api_key)

        @app.exception_handler(Refused)
        async def refused(_request, e: Refused):
            self.metrics.refused.labels(self.model_name, str(e.status)).inc()
            return error_response(e.status, e.message, e.param, e.headers)

        @app.exception_handler(BadRequest)
        async def bad_request(_request, e: BadRequest):
            self.metrics.refused.labels(self.model_name, str(e.status)).inc()
            return error_response(e.status, str(e), e.param)

        @app.exception_handler(Exception)
        async def internal(_request, e: Exception):  # a bug here, never the client's input
            log.exception("internal error", exc_info=e)
            return error_response(500, f"internal error: {type(e).__name__}: {e}")

        @app.get("/health")
        async def health():
            if not self.runner.alive or self.closing:
                return Response(status_code=503)
            return Response(status_code=200)

        @app.get("/version")
        async def version():
            return {"version": __version__}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "bullet",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}]}

        @app.post("/tokenize")
        async def tokenize(request: HttpRequest):
            body = parse(TokenizeRequest, await request.body())
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise BadRequest("give either prompt or messages", "prompt")
            if body.messages is not None:
                chat = ChatCompletionRequest(messages=body.messages)
                ids = self._chat_ids(chat.chat(), body.add_generation_prompt)
            else:
                ids = self._encode(body.prompt, body.add_special_tokens)
            return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}

        @app.post("/detokenize")
        async def detokenize(request: HttpRequest):
            body = parse(DetokenizeRequest, await request.body())
            self._check_model(body.model)
            self._check_ids(body.tokens, "tokens", allow_empty=True)
            return {"prompt": self.tokenizer.decode(body.tokens)}

        @app.post("/v1/completions")
        async def completions(request: HttpRequest):
            body = parse(CompletionRequest, await request.body())
            self._check_model(body.model)
            ids = body.prompt if isinstance(body.prompt, list) else self._encode(body.prompt, True)
            max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
            return await self._generate(request, body, ids, max_tokens, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HttpRequest):
            body = parse(ChatCompletionRequest, await request.body())
            self._check_model(body.model)
            ids = self._chat_ids(body.chat(), body.add_generation_prompt)
            return await self._generate(request, body, ids, body.token_limit(), chat=True)

        return app

    # ---- input checks -------------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise Refused(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`).",
                          "model")

    def _encode(self, text: str, special: bool) -> list[int]:
        try:
            return self.tokenizer.encode(text, special)
        except TokenizeError as e:
            raise BadRequest(f"prompt: {e}", "prompt") from None

    def _chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt)
            # a folder's template writes the special tokens itself; the simple template gets the tokenizer's
            return self.tokenizer.encode(text, getattr(self.tokenizer, "template", None) is None)
        except TokenizeError as e:
            raise BadRequest(f"messages: {e}", "messages") from None

    def _check_ids(self, ids: list[int], field: str, allow_empty: bool = False) -> None:
        if not ids and not allow_empty:
            raise BadRequest(f"{field}: the prompt is empty", field)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"{field}: token id {bad} is outside the model's vocabulary (0..{vocab - 1})", field)

    def _limit(self, prompt_len: int, max_tokens: int | None) -> int:
        """The request's max_new_tokens; 400 naming the limit it breaks."""
        room = min(self.max_model_len, self.kv_tokens) - prompt_len
        if max_tokens is None:  # chat without a limit: the rest of the context
            if room < 1:
                raise self._too_long(prompt_len, 1)
            return room
        if max_tokens > room:
            raise self._too_long(prompt_len, max_tokens)
        return max_tokens

    def _too_long(self, prompt_len: int, max_tokens: int) -> BadRequest:
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            return BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {total} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                              "completion). Please reduce the length of the prompt or max_tokens.",
                              "prompt" if prompt_len >= self.max_model_len else "max_tokens")
        return BadRequest(f"The KV cache holds {self.kv_tokens} tokens. However, you requested {total} tokens "
                          f"({prompt_len} in the prompt, {max_tokens} for the completion). Please reduce the "
                          "length of the prompt or max_tokens.",
                          "prompt" if prompt_len >= self.kv_tokens else "max_tokens")

    # ---- generation ---------------------------------------------------------------------------------
    async def _generate(self, http: HttpRequest, body, ids: list[int], max_tokens: int | None, chat: bool):
        field = "messages" if chat else "prompt"
        self._check_ids(ids, field)
        self._check_ids(body.stop_token_ids or [], "stop_token_ids", allow_empty=True)
        max_new = self._limit(len(ids), max_tokens)
        sampling = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                                  ignore_eos=body.ignore_eos)
        stop_ids = frozenset(body.stop_token_ids or ())
        if not body.ignore_eos:
            stop_ids |= self.tokenizer.stop_token_ids
        if self.closing or not self.runner.alive:
            raise Refused(503, self.runner.error or "the server is shutting down")
        if self.outstanding >= self.capacity:
            raise Refused(429, f"the server is full ({self.outstanding} requests outstanding, at most "
                               f"{self.capacity}): retry later", headers={"Retry-After": "1"})
        rid = next(self._ids)
        req = Request(rid, self.engine.executor.now(), len(ids), max_new, prompt_ids=tuple(ids), sampling=sampling)
        gen = Generation(self, req, body.stops(), stop_ids)
        self.streams[rid] = gen
        try:
            self.runner.submit(req)
        except EngineDead as e:
            self.streams.pop(rid, None)
            raise Refused(503, str(e)) from None
        self.outstanding += 1
        reply = _Reply(self, gen, body, chat)
        if body.stream:
            return EventStream(reply.events(), gen.close)
        return await reply.whole(http)


class _Reply:
    """The OpenAI-shaped answer of one generation: SSE chunks or one JSON body."""

    def __init__(self, server: BulletServer, gen: Generation, body, chat: bool) -> None:
        self.server, self.gen, self.body, self.chat = server, gen, body, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{gen.req.id}"
        self.created = int(time.time())
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous = bool(opts and opts.continuous_usage_stats and self.include_usage)

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name}

    def _choice(self, piece: Piece, stream: bool) -> dict:
        if self.chat:
            if stream:
                choice = {"index": 0, "delta": {"content": piece.text} if piece.text or not piece.finish_reason
                          else {}, "logprobs": None, "finish_reason": piece.finish_reason}
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": piece.text},
                          "logprobs": None, "finish_reason": piece.finish_reason}
        else:
            choice = {"index": 0, "text": piece.text, "logprobs": None, "finish_reason": piece.finish_reason}
        choice["stop_reason"] = piece.stop_reason
        if self.body.return_token_ids:
            choice["token_ids"] = list(piece.token_ids)
        return choice

    async def events(self) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        usage_field = {"usage": None} if self.include_usage else {}
        if self.chat:  # the first chunk names the role
            first = {**self._head(kind), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}], **usage_field}
            if self.body.return_token_ids:
                first["prompt_token_ids"] = list(self.gen.req.prompt_ids)
            yield json.dumps(first)
        elif self.body.return_token_ids:
            yield json.dumps({**self._head(kind), "choices": [{"index": 0, "text": "", "logprobs": None,
                                                                "finish_reason": None, "token_ids": []}],
                              "prompt_token_ids": list(self.gen.req.prompt_ids), **usage_field})
        async for piece in self.gen.pieces():
            if piece.error is not None and piece.finish_reason == "abort":
                status = 503
                yield json.dumps({"error": {"message": piece.error, "type": ERROR_TYPES[status], "param": None,
                                            "code": status}})
            chunk = {**self._head(kind), "choices": [self._choice(piece, True)]}
            if self.continuous:
                chunk["usage"] = self.gen.usage()
            elif self.include_usage:
                chunk["usage"] = None
            yield json.dumps(chunk)
        if self.include_usage:
            yield json.dumps({**self._head(kind), "choices": [], "usage": self.gen.usage()})
        yield "[DONE]"

    async def whole(self, http: HttpRequest):
        gen = self.gen

        async def collect() -> tuple[list[Piece], Piece | None]:
            pieces = [p async for p in gen.pieces()]
            return pieces, (pieces[-1] if pieces else None)

        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(_until_disconnect(http.receive))
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            gen.close()
        if not work.done() or work.cancelled():  # the client went away: nobody to answer
            return Response(status_code=499)
        pieces, last = work.result()
        if last is not None and last.error is not None:  # the server could not finish it: no partial 200
            raise Refused(503, last.error)
        text = "".join(p.text for p in pieces)
        ids = tuple(t for p in pieces for t in p.token_ids)
        final = Piece(text, ids, last.finish_reason if last else "abort", last.stop_reason if last else None)
        kind = "chat.completion" if self.chat else "text_completion"
        out = {**self._head(kind), "choices": [self._choice(final, False)], "usage": gen.usage()}
        if self.body.return_token_ids:
            out["prompt_token_ids"] = list(gen.req.prompt_ids)
        return out


# ---- uvicorn ------------------------------------------------------------------------------------------
def run_http(server: BulletServer, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
             log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, let the engine finish in-flight requests within
    ``drain_timeout`` seconds, abort the rest (their streams end with finish_reason "abort"), and return."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn re-raises the signal after shutdown; we exit normally instead
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def on_signal(sig, _frame):
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True  # a second Ctrl-C: stop waiting
                self.should_exit = True
                server.begin_shutdown(drain_timeout)

            previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout + 5.0, lifespan="on")
    srv = _Server(config)
    try:
        srv.run()
    except SystemExit:  # uvicorn exits when the start-up failed
        if server.runner.error is None:
            raise
    if not srv.started and server.runner.error is not None:  # the engine thread's warm-up failed
        raise RuntimeError(server.runner.error)
