"""Byte-level BPE tokenizer of the bundled model (`tokenizers` library), saved as tokenizer.json.

Owns training the tokenizer and the reserved ids; the gateway reads the saved file through its
own `HFTokenizer` and never imports this module.

Reserved ids (docs/model.md §1.1 conventions, `training.model_config`):

* 0 = `<|bos|>`, 1 = `<|eos|>`: special added tokens (decoding skips them);
* vocab_size - 1 = the DSpark noise token (`dspark_noise_token_id`): reserved OUTSIDE the
  tokenizer: tokenizer.json holds ids 0..vocab_size-2 only, so no text can ever encode to it,
  and decoding skips it as an unknown id. (A special added token would not do: the library
  matches added tokens' literal text in the input, and its switch to stop that,
  `encode_special_tokens`, is not saved in tokenizer.json.)

Pre-tokenization: GPT-2's split rule with one change, digits are split one by one (optionally
with their leading space: " 16" -> " 1", "6"), so counting and arithmetic see digits; then the
byte-level mapping (every byte has a token, no unknown text). Merges are learned on the
corpus's training split (`training.corpus`). `TextTokenizer.encode` also turns the library's
special-token matching off, so corpus text never yields bos/eos either; the gateway's
`HFTokenizer` reads the same file (there a literal "<|eos|>" in a prompt would be eos).
Run: `python -m training.tokenizer --corpus runs/corpus --out runs/tokenizer/tokenizer.json`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Iterable, Sequence

BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 0, 1
SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train the byte-level BPE on `texts`; returns a `tokenizers.Tokenizer` of vocab_size - 1 ids.

    Ids: 0 bos, 1 eos, 2..257 the 256 bytes, then merges; vocab_size - 1 is left for the
    noise token. Deterministic for the same texts in the same order.
    Raises:
        ValueError: vocab_size < 260, or the texts are too small to learn vocab_size - 259 merges.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 260:
        raise ValueError(f"vocab_size={vocab_size}: needs room for bos, eos, 256 bytes and the noise id")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size - 1:
        raise ValueError(f"learned {tok.get_vocab_size()} ids, need {vocab_size - 1}: the training text is too small")
    return tok


class TextTokenizer:
    """A saved tokenizer.json with the model's id conventions (see the module docstring).

    Args:
        path: tokenizer.json.
        vocab_size: the model's vocabulary (tokenizer ids + 1 for the noise token); default:
            the file's size + 1.
    Raises:
        ValueError: bos/eos not at ids 0/1, or the file's size is not vocab_size - 1.
    """

    def __init__(self, path: str | Path, vocab_size: int | None = None):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self._tok.encode_special_tokens = True  # literal "<|eos|>" in text stays text
        n = self._tok.get_vocab_size()
        self.vocab_size = n + 1 if vocab_size is None else vocab_size
        self.noise_token_id = self.vocab_size - 1
        if self._tok.token_to_id(BOS) != BOS_ID or self._tok.token_to_id(EOS) != EOS_ID:
            raise ValueError(f"{path}: {BOS} / {EOS} must have ids {BOS_ID} / {EOS_ID}")
        if n != self.vocab_size - 1:
            raise ValueError(f"{path}: holds {n} ids, expected vocab_size - 1 = {self.vocab_size - 1}")

    def encode(self, text: str) -> list[int]:
        """Text -> ids in [2, vocab_size - 1) (never bos, eos or the noise id)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of several texts (the library parallelises)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_document(self, text: str) -> list[int]:
        """[bos] + encode(text) + [eos]: one training document."""
        return [BOS_ID, *self.encode(text), EOS_ID]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text; bos, eos and the noise id are skipped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def main() -> None:
    from training.corpus import read_documents

    ap = argparse.ArgumentParser(description="Train the bundled model's byte-level BPE on the corpus's train split.")
    ap.add_argument("--corpus", type=Path, default=Path("runs/corpus"))
    ap.add_argument("--out", type=Path, default=Path("runs/tokenizer/tokenizer.json"))
    ap.add_argument("--vocab-size", type=int, default=None, help="default: training.model_config.VOCAB_SIZE")
    args = ap.parse_args()
    from training.model_config import VOCAB_SIZE

    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # leave the other core to other work
    vocab = args.vocab_size or VOCAB_SIZE
    tok = train_tokenizer((d.text for d in read_documents(args.corpus / "train.jsonl")), vocab)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    t = TextTokenizer(args.out, vocab)
    print(f"saved {args.out}: {vocab - 1} ids + noise id {t.noise_token_id}")
    by: dict[str, list[int]] = {}
    for d in read_documents(args.corpus / "heldout.jsonl"):
        n = by.setdefault(d.domain, [0, 0])
        n[0] += len(d.text)
        n[1] += len(t.encode(d.text))
    print("held-out characters per token:", {k: round(c / max(1, n), 2) for k, (c, n) in by.items()})


if __name__ == "__main__":
    main()
