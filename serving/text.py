"""From token ids to the text a client may see: incremental decoding, stop strings, chat prompts."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from tasks.errors import LlmoptError


class RequestError(LlmoptError):
    """A request the server refuses with a 4xx status; the message names the culprit."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class TextStream:
    """Text of a growing list of token ids, released in safe pieces: never half a UTF-8 character, never text
    that may turn out to be the start of a stop string, nothing from a stop string on.

    Decoding is incremental (as TGI and vLLM do it): only the ids since the last settled point are decoded, with
    a few ids before them as context, so a long answer costs linear time and tokenizers that drop a leading space
    at the start of a decode still join pieces correctly."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._tokenizer, self._stops = tokenizer, [stop for stop in stops if stop]
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False  # a stop string was found; nothing more is released
        self.stop_text = ""  # the stop string that ended the text (TGI's answers keep it; OpenAI's do not)
        self._decoded = ""  # the text of `ids[:_read]`
        self._prefix = self._read = 0  # context start and settled end of the ids decoded so far

    def push(self, token: int) -> str:
        """Add a generated token; the newly releasable text ('' while held back)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) < len(before):  # a multi-byte character is not complete yet
            return ""
        self._decoded += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back at the end (a stop string's possible start that never completed)."""
        if self.stopped:
            return ""
        self._decoded += self._decode(self.ids[self._prefix :])[
            len(self._decode(self.ids[self._prefix : self._read])) :
        ]
        self._read = len(self.ids)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _release(self, final: bool) -> str:
        full = self._decoded
        found = [(index, stop) for stop in self._stops if (index := full.find(stop)) >= 0]
        if found:
            cut, self.stop_text = min(found, key=lambda hit: hit[0])
            self.stopped, upto = True, full[:cut]
        else:
            held = 0 if final else max((_overlap(full, stop) for stop in self._stops), default=0)
            upto = full[: len(full) - held]
        delta = upto[len(self.text) :] if upto.startswith(self.text) else ""
        self.text += delta
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper start of `stop`."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The model's own chat template applied to `messages`, ending where the assistant's answer starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(400, "this model's tokenizer has no chat template; use /v1/completions")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template's own checks (e.g. roles must alternate) are the client's error
        raise RequestError(400, f"messages do not fit the model's chat template: {exc}") from None


INLINE_CHARS = 4096  # prompts this long at most are tokenized on the event loop (under a millisecond)
_LONGEST: dict[int, tuple[Any, int]] = {}  # id(tokenizer) → (the tokenizer, its longest entry)
# Longer prompts are tokenized here, one at a time: however many arrive, they take one core from the engine at most
_LONG_PROMPTS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmopt-tokenize")


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: the longest vocabulary entry (byte-level BPE spells
    each byte as one character, SentencePiece each character as itself, added tokens are their own text)."""
    known = _LONGEST.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        known = (tokenizer, max([len(entry) for entry in tokenizer.get_vocab()] + [1]))
        _LONGEST[id(tokenizer)] = known
    return known[1]


async def encode_prompt(runtime: Any, text: str, max_tokens: int) -> list[int]:
    """A prompt's token ids without holding up the event loop (so other requests' streams go on): a text that
    cannot fit the context with `max_tokens` however it tokenizes (each token covers at most
    `longest_token_chars` characters) is refused unread; a long one is tokenized on a worker thread (the
    tokenizer releases the GIL), one such prompt at a time."""
    import asyncio

    context = runtime.context_length
    at_least = -(-len(text) // longest_token_chars(runtime.tokenizer))
    if at_least + max_tokens > context:
        raise RequestError(
            400,
            f"prompt (at least {at_least} tokens: {len(text)} characters) + max_tokens ({max_tokens}) exceeds the "
            f"model's context of {context} tokens",
            "context_length_exceeded",
        )
    if len(text) <= INLINE_CHARS:
        return runtime.encode(text)
    return await asyncio.get_running_loop().run_in_executor(_LONG_PROMPTS, runtime.encode, text)
