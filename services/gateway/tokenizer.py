"""Tokenizers for the gateway and incremental detokenization with stop strings.

This module owns text <-> token ids and the stop-string cut of the streamed text. It must not
end a generation on token ids or budgets (the scheduler checks stop token ids and max_tokens).

`load_tokenizer(path)` reads a Hugging Face `tokenizer.json` with the `tokenizers` library; a
checkpoint without one (random test models) gets `ByteTokenizer`, which maps UTF-8 bytes to
ids 2..257 and shows any other id as `<id>`. `Detokenizer` turns a growing list of ids into
text deltas that concatenate exactly to the final text and applies stop strings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

BYTE_OFFSET = 2  # ids 0 and 1 are bos / eos in the DeepSeek convention


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_str(self, token_id: int) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes <-> ids byte + 2; other ids (bos, eos, >= 258) decode to `<id>` (eos to "").

    Raises:
        ValueError: vocab_size too small to hold the byte ids.
    """

    def __init__(self, vocab_size: int, eos_token_id: int = 1):
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"vocab_size={vocab_size}: ByteTokenizer needs at least {BYTE_OFFSET + 256} ids")
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                buf.append(i - BYTE_OFFSET)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if i != self.eos_token_id:
                out.append(f"<{i}>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_str(self, token_id: int) -> str:
        """The vocabulary entry of one id: its byte as text (U+FFFD for a lone byte of a
        multi-byte character), else `<id>`."""
        return self.decode([token_id]) if BYTE_OFFSET <= token_id < BYTE_OFFSET + 256 else f"<{token_id}>"


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json; special tokens are skipped when decoding."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok
        self._tok = _Tok.from_file(str(path))

    @property
    def hf(self):
        """The underlying `tokenizers.Tokenizer` (the grammar vocabulary reads its tokens)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        """The vocabulary entry of one id as tokenizer.json spells it ("" for an unknown id)."""
        return self._tok.id_to_token(token_id) or ""


def load_tokenizer(checkpoint: str | Path | None, vocab_size: int, eos_token_id: int) -> Tokenizer:
    """`checkpoint/tokenizer.json` if present, else a `ByteTokenizer`."""
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").is_file():
        return HFTokenizer(Path(checkpoint) / "tokenizer.json")
    return ByteTokenizer(vocab_size, eos_token_id)


class Detokenizer:
    """Incremental text for a growing completion, with stop strings.

    `add(token_id)` returns the text delta that became final with this token. Text is held
    back while it ends in an incomplete UTF-8 sequence (U+FFFD) or could be the start of a
    stop string, so the deltas always concatenate to `text`. When a stop string appears,
    `stopped` is set and the text is cut before it (the stop string is not returned). Stop
    strings are looked for only once more than `min_tokens` tokens were added (vLLM's rule:
    min_tokens holds every stop condition off).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), min_tokens: int = 0):
        self.tokenizer, self.min_tokens = tokenizer, int(min_tokens)
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""          # text released so far
        self.stopped = False

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids)
        cut = self._stop_at(full) if len(self.ids) > self.min_tokens else None
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        ready = full.rstrip("\ufffd")  # an unfinished multi-byte character stays back
        hold = max((_partial_suffix(ready, s) for s in self.stop), default=0)
        return self._release(ready[: len(ready) - hold])

    def finish(self) -> str:
        """At the end of the generation: release everything still held back (not after a stop)."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.ids))

    def _stop_at(self, full: str) -> int | None:
        # A stop string that ends inside the released text was released under min_tokens (it
        # would have stopped the generation otherwise): look only at what overlaps new text.
        hits = [full.find(s, max(0, len(self.text) - len(s) + 1)) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    def _release(self, upto: str) -> str:
        if not upto.startswith(self.text) or len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text):]
        self.text = upto
        return delta


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
