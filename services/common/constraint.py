"""Structured-output constraints: what a request may constrain its output to, and their compilation.

This module owns the `Constraint` value a request carries (JSON Schema, any JSON object,
regular expression, EBNF/GBNF grammar, or a choice among strings), its validation, and its
compilation into an XGrammar `CompiledGrammar` against a model vocabulary (`GrammarVocab`,
one compile cache per vocabulary). The verifier and the drafter both compile the constraint a
session carries; the gateway compiles it too, before any session opens, so a bad one is refused
with one error naming the request field (docs/structured.md).

It holds no per-generation state (the matcher lives in `services.common.grammar`), runs no
model and knows nothing of gRPC or HTTP.

Dimension legend: V = the model's vocab_size (logits width; the bitmask covers it).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import xgrammar as xgr

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
CACHE_SIZE = 256  # compiled constraints kept per vocabulary (LRU): a compile is ms, a hit us
MAX_SPEC_CHARS = 1 << 20  # a constraint's text; beyond it a request is refused, not compiled


class ConstraintError(ValueError):
    """A constraint the compiler refuses; the message names the request field."""


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint.

    kind: one of KINDS. spec: the schema (JSON text), the regex, the EBNF/GBNF grammar, or the
    choices as a JSON list of strings; "" for json_object. field: the request field it came
    from (named in errors; not part of its identity for the compile cache).
    """

    kind: str
    spec: str = ""
    field: str = "constraint"

    @property
    def key(self) -> tuple[str, str]:
        """Identity for the compile cache: (kind, spec)."""
        return self.kind, self.spec


def make_constraint(kind: str, spec: object = "", field: str = "constraint") -> Constraint:
    """Build a `Constraint` from a request's value, normalising it.

    spec: json_schema a dict or JSON text (an object or boolean schema); json_object ignored;
    regex / grammar a non-empty str; choice a non-empty sequence of non-empty strings (or
    their JSON list text). Raises:
        ConstraintError: unknown kind, spec of the wrong type, empty, too long, a schema that
            is not JSON, a choice with an empty or duplicate string (each names `field`).
    """
    if kind not in KINDS:
        raise ConstraintError(f"{field}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "json_object":
        return Constraint(kind, "", field)
    if kind == "json_schema":
        spec = _schema_text(spec, field)
    elif kind == "choice":
        spec = _choice_text(spec, field)
    elif not isinstance(spec, str) or not spec:
        raise ConstraintError(f"{field}: a {kind} constraint needs a non-empty string, got {spec!r:.80}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ConstraintError(f"{field}: {len(spec)} characters, more than {MAX_SPEC_CHARS}")
    return Constraint(kind, spec, field)


def _schema_text(spec: object, field: str) -> str:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"{field}: the JSON schema is not JSON: {exc}") from None
    if not isinstance(spec, (dict, bool)):
        raise ConstraintError(f"{field}: a JSON schema must be an object, got {type(spec).__name__}")
    return json.dumps(spec, separators=(",", ":"))  # key order kept: it is the output's property order


def _choice_text(spec: object, field: str) -> str:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise ConstraintError(f"{field}: choices must be a list of strings, got {spec!r:.80}") from None
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence) or not spec:
        raise ConstraintError(f"{field}: choices must be a non-empty list of strings, got {spec!r:.80}")
    if not all(isinstance(c, str) and c for c in spec):
        raise ConstraintError(f"{field}: every choice must be a non-empty string, got {list(spec)!r:.120}")
    if len(set(spec)) != len(spec):
        raise ConstraintError(f"{field}: duplicate choices in {list(spec)!r:.120}")
    return json.dumps(list(spec), ensure_ascii=False)


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF accepting exactly one of `choices` (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# ---------------------------------------------------------------------------- vocabularies
class GrammarVocab:
    """A model vocabulary as XGrammar sees it, with its compile cache.

    Args:
        tokens: V entries, one per token id: its text (byte-level BPE form for `byte_level`,
            raw bytes or str otherwise); "" marks a special token the grammar never allows.
        vocab_size: V, the logits width (>= len(tokens); ids past the tokens are never allowed).
        eos_token_id: the stop token, allowed only where the grammar may end.
        byte_level: tokens are in GPT-2 byte-level form (tokenizer.json BPE with a ByteLevel
            pre-tokenizer) rather than raw text.
    Thread safe: the verifier's step loop and the gateway's request threads share one.
    """

    def __init__(self, tokens: Sequence[str | bytes], vocab_size: int, eos_token_id: int, byte_level: bool = False):
        kind = xgr.VocabType.BYTE_LEVEL if byte_level else xgr.VocabType.RAW
        self.vocab_size, self.eos_token_id = int(vocab_size), int(eos_token_id)
        self.info = xgr.TokenizerInfo(list(tokens), vocab_type=kind, vocab_size=self.vocab_size,
                                      stop_token_ids=[self.eos_token_id])
        self._compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, c: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar of `c` (cached per (kind, spec)).

        Raises:
            ConstraintError: the compiler refuses it (a schema it cannot convert, a regex or
                grammar that does not parse), or a grammar with no accepting path; the message
                names `c.field`.
        """
        with self._lock:
            hit = self._cache.get(c.key)
            if hit is not None:
                self._cache.move_to_end(c.key)
                return hit
        compiled = self._compile(c)
        with self._lock:
            self._cache[c.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        try:
            if c.kind == "json_schema":
                grammar = xgr.Grammar.from_json_schema(c.spec, any_whitespace=False, strict_mode=True)
            elif c.kind == "json_object":
                grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif c.kind == "regex":
                grammar = xgr.Grammar.from_regex(c.spec)
            elif c.kind == "choice":
                grammar = xgr.Grammar.from_ebnf(choice_grammar(json.loads(c.spec)))
            else:
                grammar = xgr.Grammar.from_ebnf(c.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConstraintError(f"{c.field}: the {c.kind.replace('_', ' ')} does not compile: "
                                  f"{_library_message(exc)}") from None
        if c.kind in ("json_schema", "json_object"):
            grammar = _strict_json_strings(grammar)
        if not productive(str(grammar)):
            raise ConstraintError(f"{c.field}: the {c.kind.replace('_', ' ')} has no accepting path "
                                  "(its root rule derives no finite string)")
        compiled = self._compiler.compile_grammar(grammar)
        if not _can_start(compiled, self.vocab_size):
            raise ConstraintError(f"{c.field}: no token of the model's vocabulary can start the "
                                  f"{c.kind.replace('_', ' ')}")
        return compiled


# XGrammar 0.2.9 writes the characters of a length-bounded JSON string as [^"\\\r\n]: a raw
# control character would pass, which JSON forbids (a strict parser refuses the output).
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_STRICT_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def _strict_json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with every JSON string character class excluding control characters."""
    text = str(grammar)
    return grammar if _LOOSE_STRING_CHAR not in text else xgr.Grammar.from_ebnf(
        text.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR))


def _can_start(compiled: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """Whether the vocabulary allows some first token (eos counts: an empty output is one)."""
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _library_message(exc: Exception) -> str:
    """XGrammar's error without its source-file prefix ("[time] /path/file.cc:N: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)


def byte_vocab(vocab_size: int, eos_token_id: int, offset: int = 2) -> GrammarVocab:
    """The vocabulary of `services.gateway.tokenizer.ByteTokenizer`: ids offset..offset+255 are
    the bytes, every other id is special (never allowed; eos where the grammar may end)."""
    tokens: list[bytes | str] = [""] * vocab_size
    for b in range(256):
        tokens[b + offset] = bytes([b])
    return GrammarVocab(tokens, vocab_size, eos_token_id)


def tokenizer_vocab(tok, vocab_size: int, eos_token_id: int) -> GrammarVocab:
    """The vocabulary of a `tokenizers.Tokenizer` (its special tokens never allowed).

    Raises:
        ValueError: the tokenizer holds more tokens than vocab_size.
    """
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ValueError(f"the tokenizer holds {n} tokens, more than the model's vocab_size={vocab_size}")
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    tokens = ["" if i in special else (tok.id_to_token(i) or "") for i in range(n)]
    return GrammarVocab(tokens, vocab_size, eos_token_id, byte_level=type(tok.decoder).__name__ == "ByteLevel")


def vocab_of(tokenizer: object, vocab_size: int, eos_token_id: int) -> GrammarVocab:
    """The grammar vocabulary of a gateway tokenizer (`services.gateway.tokenizer`): an
    `HFTokenizer`'s (its `hf` Tokenizer), else the byte vocabulary of `ByteTokenizer`."""
    hf = getattr(tokenizer, "hf", None)
    return byte_vocab(vocab_size, eos_token_id) if hf is None else tokenizer_vocab(hf, vocab_size, eos_token_id)


def checkpoint_vocab(checkpoint: str | Path | None, vocab_size: int, eos_token_id: int) -> GrammarVocab:
    """The grammar vocabulary matching `services.gateway.tokenizer.load_tokenizer`: the
    checkpoint's tokenizer.json when present, else the byte vocabulary."""
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        return tokenizer_vocab(Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json")), vocab_size, eos_token_id)
    return byte_vocab(vocab_size, eos_token_id)


def resolve_vocab(vocab, vocab_size: int, eos_token_id: int) -> GrammarVocab:
    """A service's grammar vocabulary from what it was given: a `GrammarVocab`, a zero-argument
    callable making one (built on the first constrained request: serving without constraints
    never pays for a large vocabulary), or None (the byte vocabulary of vocab_size)."""
    if isinstance(vocab, GrammarVocab):
        return vocab
    return byte_vocab(vocab_size, eos_token_id) if vocab is None else vocab()


# ---------------------------------------------------------------------------- productivity
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*([*?]|\{0,?\d*\})?")


def productive(normalized: str) -> bool:
    """Whether the root rule of a grammar in XGrammar's normalised form (`str(Grammar)`)
    derives a finite string: the fixpoint of "a rule is productive when one alternative
    references only productive rules" (a reference under `*`, `?` or a {0,n} repeat may be
    absent). Text it cannot read is taken as productive: only a proven dead end is refused."""
    rules: dict[str, list[list[str]]] = {}
    for line in normalized.splitlines():
        m = _RULE.match(line.strip())
        if not m:
            if line.strip():
                return True
            continue
        rules[m.group(1)] = [_needed(alt) for alt in _alternatives(m.group(2))]
    if "root" not in rules:
        return True
    done: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in done and any(all(r in done or r not in rules for r in alt) for alt in alts):
                done.add(name)
                changed = True
    return "root" in done


def _alternatives(body: str) -> list[str]:
    """Split a normalised rule body at its top-level `|` (literals and classes skipped)."""
    text = _LITERAL.sub(lambda m: " " * len(m.group(0)), body.strip())
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "|" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _needed(alt: str) -> list[str]:
    """Rule names an alternative needs (literals already blanked; optional references dropped;
    a parenthesised group under * or ? is dropped whole)."""
    alt = re.sub(r"\([^()]*\)[*?]", " ", alt)
    return [m.group(0) for m in _NAME.finditer(alt) if not m.group(1)]
