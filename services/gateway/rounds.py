"""Recorded speculative rounds: the documented JSON format (docs/gate.md §9) with load/save and validation.

This module owns the file format, its strict reader and its deterministic writer. It must not
interpret rounds (the replay does) or let through anything the format does not define.

A file is one JSON object:

    {
      "format": "dspark-rounds",
      "version": 1,
      "metadata": {...},            # free-form JSON object (source, model, date, generator ...)
      "rounds": [
        {"workload": "code",                  # label the replay groups by
         "confidence_logits": [2.1, 0.4, ...], # one per DRAFTED position (may be empty: no draft)
         "submitted": 5,                       # draft tokens sent to verify (0 = none)
         "accepted": 3,                        # accepted draft tokens, bonus not counted
         "anchor_margin": 7.25,                # optional: anchor's top1 - top2 logit, >= 0
         "draft_ms": 190.0, "verify_ms": 840.0, "plain_ms": null},   # optional timings, ms
         # optional, the decision's inputs and outputs: "survival", "values", "rate", and
         # "probe_loss" (a probe round's priced loss, tokens), "lent_streak" (true: decided
         # inside a losing streak lent by the band), docs/gate.md §9
        ...
      ]
    }

Optional keys may be absent or null (the writer omits them when null). Unknown keys, duplicate
keys and non-finite numbers (NaN, Infinity, 1e400) are errors anywhere in the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common import files
from services.gateway.values import finite_float, short_repr

FORMAT_NAME = "dspark-rounds"
FORMAT_VERSION = 1
MAX_FILE_BYTES = 256 * 1024 * 1024  # load_rounds refuses larger files (and non-regular ones)
MAX_INT_DIGITS = 4300  # longer integer literals are refused (Python's int <-> str limit)
MAX_METADATA_DEPTH = 100  # nesting levels of metadata objects and lists
RESERVED_WORKLOAD = "overall"  # the replay's totals row
_REQUIRED = ("workload", "confidence_logits", "submitted", "accepted")
_OPTIONAL = ("anchor_margin", "draft_ms", "verify_ms", "plain_ms")
# The length decision's inputs and outputs (docs/gate.md §9): lists of numbers, and lambda.
_DECISION = ("survival", "values", "rate", "probe_loss", "lent_streak")


def _is_number(value: object) -> bool:
    return finite_float(value) is not None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_metadata(metadata: object) -> None:
    """Metadata must round-trip through JSON: string keys, finite numbers, bounded nesting."""
    if not isinstance(metadata, Mapping):
        raise ValueError(f"'metadata' must be an object, got {type(metadata).__name__}")
    stack = [(metadata, "metadata", 1)]
    while stack:  # iterative: a deep document must not overflow the Python stack
        value, where, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            raise ValueError(f"'{where}' nests deeper than {MAX_METADATA_DEPTH} levels")
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValueError(f"'{where}' has a non-string key {short_repr(key)}")
                stack.append((item, f"{where}.{key}", depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, float) and finite_float(value) is None:
            raise ValueError(f"'{where}'={value!r} must be a finite number")
        elif value is not None and not isinstance(value, (str, int, float)):
            raise ValueError(f"'{where}' has a {type(value).__name__}, not a JSON value")


def check_workload(label: object) -> None:
    """Raise ValueError unless `label` is a usable workload: a non-blank string other than
    "overall" in any case (the replay's totals row). Recorders can check labels up front."""
    if not isinstance(label, str) or not label.strip():
        raise ValueError(f"field 'workload'={short_repr(label)} must be a non-blank string")
    if label.strip().casefold() == RESERVED_WORKLOAD:
        raise ValueError(f"field 'workload'={short_repr(label)} is reserved for the totals row")


@dataclass(frozen=True)
class Round:
    """One recorded round. Counts in tokens, timings in ms; optional fields are None when unknown.

    Raises ValueError naming the field when a value has the wrong type, is not finite (or too
    large for a float), breaks accepted <= submitted <= len(confidence_logits), or the workload
    is blank or the reserved name "overall" (any case: it would collide with the totals row).
    """

    workload: str
    confidence_logits: tuple[float, ...]
    submitted: int
    accepted: int
    anchor_margin: float | None = None
    draft_ms: float | None = None
    verify_ms: float | None = None
    plain_ms: float | None = None
    survival: tuple[float, ...] | None = None
    values: tuple[float, ...] | None = None
    rate: float | None = None
    probe_loss: float | None = None
    lent_streak: bool | None = None

    def __post_init__(self) -> None:
        check_workload(self.workload)
        self._check_decision()
        if not isinstance(self.confidence_logits, tuple):
            raise ValueError(f"field 'confidence_logits' must be a tuple, got {type(self.confidence_logits).__name__}")
        for pos, c in enumerate(self.confidence_logits):
            if not _is_number(c):
                raise ValueError(f"field 'confidence_logits'[{pos}]={short_repr(c)} must be a finite number")
        for name in ("submitted", "accepted"):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"field '{name}'={short_repr(getattr(self, name))} must be an integer >= 0")
        if self.submitted > len(self.confidence_logits):
            raise ValueError(
                f"field 'submitted'={self.submitted} exceeds len(confidence_logits)={len(self.confidence_logits)}"
            )
        if self.accepted > self.submitted:
            raise ValueError(f"field 'accepted'={self.accepted} exceeds submitted={self.submitted}")
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value >= 0):
                raise ValueError(f"field '{name}'={short_repr(value)} must be null or a finite number >= 0")

    def _check_decision(self) -> None:
        """survival: numbers in [0, 1], at most one per confidence; values: finite numbers;
        rate: a finite number >= 0; probe_loss: a finite number (tokens; present: a probe
        round); lent_streak: a bool (each may be None). Raises ValueError naming the field."""
        for name in ("survival", "values"):
            seq = getattr(self, name)
            if seq is None:
                continue
            if not isinstance(seq, tuple) or not all(_is_number(v) for v in seq):
                raise ValueError(f"field '{name}'={short_repr(seq)} must be null or a list of finite numbers")
        if self.survival is not None and (len(self.survival) > len(self.confidence_logits)
                                          or not all(0.0 <= v <= 1.0 for v in self.survival)):
            raise ValueError(f"field 'survival'={short_repr(self.survival)} must hold probabilities, "
                             f"at most one per confidence")
        if self.rate is not None and not (_is_number(self.rate) and self.rate >= 0):
            raise ValueError(f"field 'rate'={short_repr(self.rate)} must be null or a finite number >= 0")
        if self.probe_loss is not None and not _is_number(self.probe_loss):
            raise ValueError(f"field 'probe_loss'={short_repr(self.probe_loss)} must be null or a finite number")
        if self.lent_streak is not None and not isinstance(self.lent_streak, bool):
            raise ValueError(f"field 'lent_streak'={short_repr(self.lent_streak)} must be null or a boolean")

    @property
    def probe(self) -> bool:
        """The gate decided this round as a probe (it verifies at least one draft)."""
        return self.probe_loss is not None

    def to_json_dict(self) -> dict:
        """The round as written to a file: required keys, then the non-null optional ones."""
        out = {"workload": self.workload, "confidence_logits": list(self.confidence_logits)}
        out["submitted"], out["accepted"] = self.submitted, self.accepted
        out.update({k: getattr(self, k) for k in _OPTIONAL if getattr(self, k) is not None})
        out.update({k: (list(v) if isinstance(v, tuple) else v) for k in _DECISION
                    if (v := getattr(self, k)) is not None})
        return out


@dataclass(frozen=True)
class RoundLog:
    """A file's rounds (in recorded order) and its free-form metadata.

    Raises ValueError when metadata would not round-trip through JSON (non-string key, NaN or
    inf, a non-JSON value, nesting deeper than MAX_METADATA_DEPTH).
    """

    rounds: tuple[Round, ...]
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_metadata(self.metadata)

    def workloads(self) -> dict[str, list[Round]]:
        """Rounds grouped by workload label, labels in order of first appearance, rounds in order."""
        groups: dict[str, list[Round]] = {}
        for r in self.rounds:
            groups.setdefault(r.workload, []).append(r)
        return groups


def _parse_round(obj: object) -> Round:
    if not isinstance(obj, Mapping):
        raise ValueError(f"must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_REQUIRED) - set(_OPTIONAL) - set(_DECISION))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"missing field '{missing[0]}'")
    confidences = obj["confidence_logits"]
    if not isinstance(confidences, list):
        raise ValueError(f"field 'confidence_logits' must be a list, got {type(confidences).__name__}")
    values = {k: obj.get(k) for k in _REQUIRED + _OPTIONAL + _DECISION}
    values["confidence_logits"] = tuple(confidences)
    for name in ("survival", "values"):
        if isinstance(values[name], list):
            values[name] = tuple(values[name])
    return Round(**values)


def parse_rounds(obj: object) -> RoundLog:
    """Validate a decoded JSON document and build a RoundLog.

    Raises ValueError naming the top-level key, or the round index and field, that is wrong.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"top level must be an object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT_NAME:
        raise ValueError(f"'format'={short_repr(obj.get('format'))}, expected {FORMAT_NAME!r}")
    version = obj.get("version")
    if not _is_count(version) or version != FORMAT_VERSION:  # the integer: not true, not 1.0
        raise ValueError(f"'version'={short_repr(version)}, this reader knows version {FORMAT_VERSION} (an integer)")
    unknown = sorted(set(obj) - {"format", "version", "metadata", "rounds"})
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown}")
    metadata = obj.get("metadata", {})
    _check_metadata(metadata)
    if not isinstance(obj.get("rounds"), list):
        raise ValueError("'rounds' must be a list")
    rounds = []
    for index, item in enumerate(obj["rounds"]):
        try:
            rounds.append(_parse_round(item))
        except ValueError as exc:
            raise ValueError(f"round {index}: {exc}") from None
    return RoundLog(tuple(rounds), dict(metadata))


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {short_repr(key)}")
        out[key] = value
    return out


def _finite_float(text: str) -> float:
    value = float(text)
    if finite_float(value) is None:
        raise ValueError(f"number {short_repr(text)} is out of float range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(text.lstrip('-'))} digits (limit {MAX_INT_DIGITS})")
    return int(text)


def _non_finite(name: str) -> float:
    raise ValueError(f"non-finite number {name} is not allowed")


def decode_rounds_json(text: str) -> object:
    """json.loads, strict: duplicate keys, NaN/Infinity, float overflow and over-long integer
    literals raise ValueError; nesting deeper than the interpreter can parse raises RecursionError."""
    return json.loads(
        text,
        object_pairs_hook=_no_duplicates,
        parse_constant=_non_finite,
        parse_float=_finite_float,
        parse_int=_bounded_int,
    )


def _read_text(path: str | Path) -> str:
    if str(path) == "":
        raise ValueError("rounds file path is empty ('')")
    try:
        return files.read_text(path, MAX_FILE_BYTES)  # OSError (names the file) when missing or unreadable
    except ValueError as exc:
        hint = "; a rounds file must be a regular file" if str(exc).startswith("is ") else ""
        raise ValueError(f"{path}: {exc}{hint}") from None


def load_rounds(path: str | Path) -> RoundLog:
    """Read and validate a rounds file. Raises ValueError naming the file on an empty path, a
    non-regular file, a file over MAX_FILE_BYTES, non-UTF-8 bytes, bad or too deeply nested JSON
    (see decode_rounds_json) or bad content; OSError (naming the file) when it cannot be read."""
    text = _read_text(path)
    try:
        obj = decode_rounds_json(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path}: not JSON this reader accepts: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON this reader accepts: {exc}") from None
    try:
        return parse_rounds(obj)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def dump_rounds(log: RoundLog) -> str:
    """Deterministic text of a rounds file: header keys, then one round per line."""
    header = [
        f'  "format": {json.dumps(FORMAT_NAME)},',
        f'  "version": {FORMAT_VERSION},',
        f'  "metadata": {json.dumps(log.metadata, sort_keys=True, allow_nan=False)},',
    ]
    lines = [json.dumps(r.to_json_dict(), allow_nan=False) for r in log.rounds]
    body = ",\n".join(f"    {line}" for line in lines)
    rounds = f'  "rounds": [\n{body}\n  ]' if lines else '  "rounds": []'
    return "{\n" + "\n".join(header) + "\n" + rounds + "\n}\n"


def save_rounds(log: RoundLog, path: str | Path) -> None:
    """Write `log` to `path` (UTF-8, trailing newline) in the format above."""
    Path(path).write_text(dump_rounds(log), encoding="utf-8")

