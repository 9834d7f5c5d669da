"""Text <-> token ids for the server, and the chat template.

Two tokenizers:
- :class:`HfTokenizer`: ``tokenizer.json`` of a model folder (the ``tokenizers`` library), with the end ids
  from ``tokenizer_config.json`` / ``generation_config.json`` / ``config.json`` and the chat template from
  ``chat_template.jinja`` or ``tokenizer_config.json``.
- :class:`ByteTokenizer`, for dummy weights (no tokenizer in the folder, or a preset name): a text is its
  UTF-8 bytes, ids 0-255; with a vocabulary larger than 256, id 256 is the end-of-sequence token and any
  higher id decodes to the placeholder ``<id>`` (random dummy weights sample all over the vocabulary, and
  every token then shows as text). A vocabulary of exactly 256 (tiny-llama) has no end-of-sequence token.

Chat template: the folder's Jinja template (rendered in a sandbox with ``messages``, ``bos_token``,
``eos_token``, ``add_generation_prompt``), else the simple one: ``<|role|>\\ncontent\\n`` per message, then
``<|assistant|>\\n``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Protocol

from ..config import ConfigError

SIMPLE_TEMPLATE = "<|{role}|>\n{content}\n"
SIMPLE_PROMPT = "<|assistant|>\n"


class TokenizeError(ValueError):
    """A text, a message list or a template that cannot be turned into ids; the message says why."""


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None  # the scheduler's end-of-sequence id
    stop_token_ids: frozenset[int]  # every id that ends a generation (eos and the model's other end ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids (see the module docstring)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ConfigError(f"the byte-level tokenizer needs a vocabulary of at least 256 ids, the model has "
                              f"{vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = 256 if vocab_size > 256 else None
        self.stop_token_ids = frozenset() if self.eos_token_id is None else frozenset((self.eos_token_id,))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise TokenizeError(f"text is not valid Unicode ({e.reason} at {e.start})") from None

    def decode(self, ids: Sequence[int]) -> str:
        parts: list[str] = []
        run = bytearray()
        for t in ids:
            if 0 <= t < 256:
                run.append(t)
                continue
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if t != self.eos_token_id:
                parts.append(f"<{t}>")
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return simple_chat(messages, add_generation_prompt)


def simple_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(SIMPLE_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages)
    return text + (SIMPLE_PROMPT if add_generation_prompt else "")


class HfTokenizer:
    """A model folder's ``tokenizer.json`` with its end ids and chat template."""

    def __init__(self, folder: str | Path, vocab_size: int) -> None:
        from tokenizers import Tokenizer as Tok

        folder = Path(folder)
        try:
            self.tok = Tok.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 -- the library raises its own types for unreadable files
            raise ConfigError(f"{folder / 'tokenizer.json'}: cannot load the tokenizer ({e})") from None
        self.vocab_size = vocab_size
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        ends: list[int] = []
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            ends.append(self.tok.token_to_id(self.eos_token))
        for source in (gen, model_cfg):
            value = source.get("eos_token_id")
            ends += [value] if isinstance(value, int) else [v for v in value or () if isinstance(v, int)]
        ends = [e for e in dict.fromkeys(ends) if 0 <= e < vocab_size]
        self.eos_token_id = ends[0] if ends else None
        self.stop_token_ids = frozenset(ends)
        self.template = _load_template(folder, cfg)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)
        except Exception as e:  # noqa: BLE001 -- a lone surrogate: TypeError, or the library's own errors
            raise TokenizeError(f"text cannot be tokenized ({e})") from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            return simple_chat(messages, add_generation_prompt)
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TokenizeError:
            raise
        except Exception as e:  # noqa: BLE001 -- a template error is about these messages (roles, order)
            raise TokenizeError(f"the chat template refused the messages: {e}") from None


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_template(folder: Path, cfg: dict):
    source = None
    file = folder / "chat_template.jinja"
    if file.exists():
        source = file.read_text()
    else:
        value = cfg.get("chat_template")
        if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default") or next(iter(named.values()), None)
        source = value if isinstance(value, str) else None
    if source is None:
        return None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizeError(f"the chat template refused the messages: {message}")

    def strftime_now(fmt: str) -> str:  # templates that print today's date (as transformers offers them)
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"{folder}: the chat template does not compile ({e})") from None


def load_tokenizer(folder: str | Path | None, vocab_size: int) -> Tokenizer:
    """The folder's ``tokenizer.json`` if there is one, else the byte-level scheme."""
    if folder is not None and (Path(folder) / "tokenizer.json").exists():
        return HfTokenizer(folder, vocab_size)
    return ByteTokenizer(vocab_size)


class Detokenizer:
    """Streamed text of one request's output ids: each ``push`` returns the new text. Text that ends in an
    unfinished character (U+FFFD: a multi-byte character split across tokens) is held back until the next
    ids complete it; ``push(final=True)`` gives everything. The text is decoded over a short window that
    starts a few ids before the new ones (at first the prompt's last ids, unless they end inside a
    character), so a tokenizer that decodes a token differently at the start of a text (a leading-space
    marker) gives the text the output continues the prompt with; byte-level schemes give the whole output
    decoded at once."""

    CONTEXT = 4  # ids of the prompt decoded as context before the first output id

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self.tok = tokenizer
        context = list(prompt_ids[-self.CONTEXT:])
        if tokenizer.decode(context).endswith("\ufffd"):  # the prompt ends inside a character: the output
            context = []  # is text of its own (what decoding it alone gives), not the end of that character
        self.ids = context
        self.prefix = 0  # window start
        self.read = len(self.ids)  # ids up to here are in the text already

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        if self.read == len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]
