"""Recorded speculative rounds: the documented JSON format (docs/gate.md) with load/save and validation.

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
        ...
      ]
    }

Optional keys may be absent or null (the writer omits them when null). Unknown keys are errors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_NAME = "dspark-rounds"
FORMAT_VERSION = 1
_REQUIRED = ("workload", "confidence_logits", "submitted", "accepted")
_OPTIONAL = ("anchor_margin", "draft_ms", "verify_ms", "plain_ms")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Round:
    """One recorded round. Counts in tokens, timings in ms; optional fields are None when unknown.

    Raises ValueError naming the field when a value has the wrong type or breaks
    accepted <= submitted <= len(confidence_logits).
    """

    workload: str
    confidence_logits: tuple[float, ...]
    submitted: int
    accepted: int
    anchor_margin: float | None = None
    draft_ms: float | None = None
    verify_ms: float | None = None
    plain_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.workload, str) or not self.workload:
            raise ValueError(f"field 'workload'={self.workload!r} must be a non-empty string")
        if not isinstance(self.confidence_logits, tuple):
            raise ValueError(f"field 'confidence_logits' must be a tuple, got {type(self.confidence_logits).__name__}")
        for pos, c in enumerate(self.confidence_logits):
            if not _is_number(c):
                raise ValueError(f"field 'confidence_logits'[{pos}]={c!r} must be a finite number")
        for name in ("submitted", "accepted"):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"field '{name}'={getattr(self, name)!r} must be an integer >= 0")
        if self.submitted > len(self.confidence_logits):
            raise ValueError(
                f"field 'submitted'={self.submitted} exceeds len(confidence_logits)={len(self.confidence_logits)}"
            )
        if self.accepted > self.submitted:
            raise ValueError(f"field 'accepted'={self.accepted} exceeds submitted={self.submitted}")
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value >= 0):
                raise ValueError(f"field '{name}'={value!r} must be null or a finite number >= 0")

    def to_json_dict(self) -> dict:
        """The round as written to a file: required keys, then the non-null optional ones."""
        out = {"workload": self.workload, "confidence_logits": list(self.confidence_logits)}
        out["submitted"], out["accepted"] = self.submitted, self.accepted
        out.update({k: getattr(self, k) for k in _OPTIONAL if getattr(self, k) is not None})
        return out


@dataclass(frozen=True)
class RoundLog:
    """A file's rounds (in recorded order) and its free-form metadata."""

    rounds: tuple[Round, ...]
    metadata: dict = field(default_factory=dict)

    def workloads(self) -> dict[str, list[Round]]:
        """Rounds grouped by workload label, labels in order of first appearance, rounds in order."""
        groups: dict[str, list[Round]] = {}
        for r in self.rounds:
            groups.setdefault(r.workload, []).append(r)
        return groups


def _parse_round(obj: object) -> Round:
    if not isinstance(obj, Mapping):
        raise ValueError(f"must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"missing field '{missing[0]}'")
    confidences = obj["confidence_logits"]
    if not isinstance(confidences, list):
        raise ValueError(f"field 'confidence_logits' must be a list, got {type(confidences).__name__}")
    values = {k: obj.get(k) for k in _REQUIRED + _OPTIONAL}
    values["confidence_logits"] = tuple(confidences)
    return Round(**values)


def parse_rounds(obj: object) -> RoundLog:
    """Validate a decoded JSON document and build a RoundLog.

    Raises ValueError naming the top-level key, or the round index and field, that is wrong.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"top level must be an object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT_NAME:
        raise ValueError(f"'format'={obj.get('format')!r}, expected {FORMAT_NAME!r}")
    if obj.get("version") != FORMAT_VERSION:
        raise ValueError(f"'version'={obj.get('version')!r}, this reader knows version {FORMAT_VERSION}")
    unknown = sorted(set(obj) - {"format", "version", "metadata", "rounds"})
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown}")
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, Mapping):
        raise ValueError(f"'metadata' must be an object, got {type(metadata).__name__}")
    if not isinstance(obj.get("rounds"), list):
        raise ValueError("'rounds' must be a list")
    rounds = []
    for index, item in enumerate(obj["rounds"]):
        try:
            rounds.append(_parse_round(item))
        except ValueError as exc:
            raise ValueError(f"round {index}: {exc}") from None
    return RoundLog(tuple(rounds), dict(metadata))


def load_rounds(path: str | Path) -> RoundLog:
    """Read and validate a rounds file. Raises ValueError (naming the file) on bad JSON or content,
    OSError when it cannot be read."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    try:
        return parse_rounds(obj)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def dump_rounds(log: RoundLog) -> str:
    """Deterministic text of a rounds file: header keys, then one round per line."""
    header = [
        f'  "format": {json.dumps(FORMAT_NAME)},',
        f'  "version": {FORMAT_VERSION},',
        f'  "metadata": {json.dumps(log.metadata, sort_keys=True)},',
    ]
    lines = [json.dumps(r.to_json_dict(), allow_nan=False) for r in log.rounds]
    body = ",\n".join(f"    {line}" for line in lines)
    rounds = f'  "rounds": [\n{body}\n  ]' if lines else '  "rounds": []'
    return "{\n" + "\n".join(header) + "\n" + rounds + "\n}\n"


def save_rounds(log: RoundLog, path: str | Path) -> None:
    """Write `log` to `path` (UTF-8, trailing newline) in the format above."""
    Path(path).write_text(dump_rounds(log), encoding="utf-8")

