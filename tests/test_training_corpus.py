"""Corpus build (training/corpus.py) and tokenizer (training/tokenizer.py) on small inputs.

Checks: byte-identical rebuilds, a held-out split disjoint from training and decided by the
document hash, non-UTF-8 code files skipped and named, troff conversion, generated text, and
the tokenizer's reserved ids (bos 0, eos 1, the DSpark noise id = vocab_size - 1 never
produced by encoding text, not even its own literal name). Nothing here reads more than a
few files of the real system; no test trains a model.
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest

from training.corpus import (KEPT_HEADING, Document, build, code_documents, man_to_text, math_documents, read_documents,
                             repeat_documents, split_of, stdlib_root, write_corpus_md)
from training.tokenizer import BOS, BOS_ID, EOS, EOS_ID, TextTokenizer, train_tokenizer

MAN_PAGE = r""".\" Copyright and other comments are dropped
.TH DEMO 1
.de XX
.ft B
..
.SH NAME
demo \- show the \fBconverter\fR
.SH DESCRIPTION
The
.B demo
tool reads
.IR files ,
one per line.
.TP
.B \-v
Be verbose.
.nf
kept  as
  typed
.fi
"""


def make_tree(root: Path) -> tuple[Path, Path]:
    """A tiny stdlib-like code folder and /usr/share-like prose folder."""
    code = root / "lib"
    (code / "pkg").mkdir(parents=True)
    (code / "site-packages").mkdir()
    for i in range(12):
        (code / "pkg" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * (i + 1))
    (code / "latin1.py").write_bytes("# caf\xe9\nx = 1\n".encode("latin-1"))
    (code / "empty.py").write_text("")
    (code / "site-packages" / "ignored.py").write_text("x = 1\n")
    share = root / "share"
    (share / "common-licenses").mkdir(parents=True)
    (share / "common-licenses" / "MIT").write_text("Permission is hereby granted, free of charge, to any person " * 6)
    for pkg in ("alpha", "beta", "gamma"):
        (share / "doc" / pkg).mkdir(parents=True)
        (share / "doc" / pkg / "copyright").write_text(
            f"Files: *\nCopyright: {pkg} authors\n\n" + "This package is free software you can redistribute it. " * 4
            + f"\n\nThe {pkg} package documents its own licensing terms in this paragraph of prose text. " * 3 + "\n")
    (share / "man" / "man7").mkdir(parents=True)
    (share / "man" / "man7" / "demo.7.gz").write_bytes(gzip.compress(MAN_PAGE.encode() + b"Some prose. " * 30))
    (share / "man" / "man7" / "alias.7.gz").write_bytes(gzip.compress(b".so man7/demo.7\n"))
    return code, share


def test_build_is_byte_identical_and_split_is_disjoint(tmp_path):
    code, share = make_tree(tmp_path)
    m1 = build(tmp_path / "a", code, share, n_math=30, n_repeat=30, seed=3, heldout_percent=30)
    m2 = build(tmp_path / "b", code, share, n_math=30, n_repeat=30, seed=3, heldout_percent=30)
    for name in ("train.jsonl", "heldout.jsonl", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert m1.outputs == m2.outputs
    train = list(read_documents(tmp_path / "a" / "train.jsonl"))
    held = list(read_documents(tmp_path / "a" / "heldout.jsonl"))
    assert train and held
    assert not {d.sha256 for d in train} & {d.sha256 for d in held}
    assert all(split_of(d, 30) == "train" for d in train) and all(split_of(d, 30) == "heldout" for d in held)
    domains = {d.domain for d in train + held}
    assert domains == {"code", "prose", "math", "repeat"}
    assert m1.skipped_code == {"not UTF-8": ["latin1.py"], "empty": ["empty.py"], "over 256 KiB": []}
    sources = {d.source for d in train + held}
    assert "stdlib/site-packages/ignored.py" not in sources and "man/man7/alias.7.gz" not in sources
    counts = {d: m1.stats["train"][d]["documents"] + m1.stats["heldout"][d]["documents"] for d in domains}
    assert counts["code"] == 12 and counts["math"] == 30 and counts["repeat"] == 30
    write_corpus_md(m1, tmp_path / "CORPUS.md")
    md = (tmp_path / "CORPUS.md").read_text()
    assert "`latin1.py`" in md and "PSF-2.0" in md
    # a rebuild keeps the hand-written section on the trained models, and only that
    record = f"{KEPT_HEADING}\n\nv3 trunk: 2,000 steps.\n"
    (tmp_path / "CORPUS.md").write_text(md.replace("## Sizes", "stale words\n## Sizes") + "\n" + record)
    write_corpus_md(m1, tmp_path / "CORPUS.md")
    assert (tmp_path / "CORPUS.md").read_text() == md + "\n" + record


def test_a_different_seed_changes_only_generated_text(tmp_path):
    code, share = make_tree(tmp_path)
    build(tmp_path / "a", code, share, n_math=5, n_repeat=5, seed=0)
    build(tmp_path / "b", code, share, n_math=5, n_repeat=5, seed=1)
    docs = [{d.source: d.text for s in ("train", "heldout") for d in read_documents(tmp_path / x / f"{s}.jsonl")}
            for x in ("a", "b")]
    real = [k for k in docs[0] if not k.startswith("generated/")]
    assert real and all(docs[0][k] == docs[1][k] for k in real)
    assert docs[0]["generated/math/0"] != docs[1]["generated/math/0"]


def test_prose_paragraphs_are_deduplicated(tmp_path):
    code, share = make_tree(tmp_path)
    build(tmp_path / "a", code, share, n_math=1, n_repeat=1, seed=0, heldout_percent=0)
    prose = [d for d in read_documents(tmp_path / "a" / "train.jsonl", ["prose"])]
    boiler = "This package is free software you can redistribute it."
    assert sum(boiler in d.text for d in prose) == 1  # the long paragraph is kept once
    assert sum("Files: *" in d.text for d in prose) == 3  # short lines repeat legitimately


def test_man_to_text():
    text = man_to_text(MAN_PAGE)
    assert text.startswith("NAME\n\ndemo - show the converter\n\nDESCRIPTION\n\n"
                           "The demo tool reads files, one per line.\n\n-v\nBe verbose.\nkept  as\n  typed\n")
    assert "Copyright" not in text and ".ft" not in text
    assert man_to_text(".so man1/other.1\n") == ""


def test_stdlib_non_utf8_fixtures_are_skipped():
    folder = stdlib_root() / "test" / "encoded_modules"
    if not folder.is_dir():
        pytest.skip(f"{folder} absent in this Python build")
    docs, skipped = code_documents(folder)
    assert set(skipped["not UTF-8"]) == {"module_iso_8859_1.py", "module_koi8_r.py"}
    assert [d.source for d in docs] == ["stdlib/__init__.py"]


def test_generated_math_is_correct_and_deterministic():
    docs = math_documents(40, seed=5)
    assert docs == math_documents(40, seed=5)
    checked = 0
    for d in docs:
        for line in d.text.splitlines():
            parts = line.split(" = ")
            if len(parts) == 2 and all(c in "0123456789+-*/ " for c in line.replace("=", "")):
                assert eval(parts[0].replace("/", "//")) == int(parts[1]), line
                checked += 1
    assert checked > 100


def test_repeat_documents_copy_from_sources_only():
    src = [Document("code", "s", "l", "alpha_line = compute_something(value)\nbeta beta gamma words here\n")]
    docs = repeat_documents(20, seed=1, sources=src)
    assert docs == repeat_documents(20, seed=1, sources=src)
    copied = [d for d in docs if "alpha_line" in d.text]
    assert copied and all(d.text.count("alpha_line = compute_something(value)") >= 3 for d in copied)
    with pytest.raises(ValueError, match="needs source documents"):
        repeat_documents(1, seed=0, sources=[])


# ----------------------------------------------------------------------------- tokenizer
TEXTS = ["def f(x):\n    return x + 1\n", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15\n",
         "The quick brown fox jumps over the lazy dog.\n", "Solve for x: 3x + 7 = 22.\n"] * 40
VOCAB = 300


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(TEXTS, VOCAB).save(str(path))
    return TextTokenizer(path, VOCAB)


def test_tokenizer_reserved_ids(tok):
    assert tok.noise_token_id == VOCAB - 1
    assert tok._tok.token_to_id(BOS) == BOS_ID == 0 and tok._tok.token_to_id(EOS) == EOS_ID == 1
    assert tok._tok.get_vocab_size() == VOCAB - 1  # the noise id lies outside tokenizer.json
    assert tok._tok.id_to_token(VOCAB - 1) is None
    assert tok.encode_document("1 2") == [0, *tok.encode("1 2"), 1]
    assert tok.decode([0, *tok.encode("x + 1"), VOCAB - 1, 1]) == "x + 1"


def test_encoding_text_never_produces_reserved_ids(tok):
    rng = random.Random(0)
    samples = [f"{BOS} a {EOS} <|dspark_noise|> <|endoftext|>", "\x00\x01\uffff\U0001f600 é ü 中文"]
    alphabet = [chr(c) for c in range(0, 0x250)] + ["\u4e2d", "\U0001f600", "\n", "\t", "  "]
    samples += ["".join(rng.choice(alphabet) for _ in range(200)) for _ in range(50)]
    samples += TEXTS[:4]
    for s in samples:
        ids = tok.encode(s)
        assert ids and min(ids) >= 2 and max(ids) < VOCAB - 1, s[:40]
        assert tok.decode(ids) == s  # byte-level: every text round-trips


def test_digits_are_single_tokens(tok):
    pieces = [tok.decode([i]) for i in tok.encode("12 345")]
    assert pieces == ["1", "2", " 3", "4", "5"]


def test_tokenizer_training_is_deterministic(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    train_tokenizer(TEXTS, VOCAB).save(str(a))
    train_tokenizer(TEXTS, VOCAB).save(str(b))
    assert a.read_bytes() == b.read_bytes()


def test_tokenizer_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="needs room"):
        train_tokenizer(TEXTS, 100)
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(["ab"], 4000)
    path = tmp_path / "t.json"
    train_tokenizer(TEXTS, VOCAB).save(str(path))
    with pytest.raises(ValueError, match="expected vocab_size - 1"):
        TextTokenizer(path, VOCAB + 5)
