"""constraints.txt: every direct dependency is pinned there, to a version its pyproject.toml
range allows, so `make setup` installs the tested set and nothing from a later release."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def pins(text: str) -> dict[str, Version]:
    """name -> pinned version of each `name==version` line (comments and blanks skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = (part.strip() for part in line.partition("=="))
            assert version and not version.startswith("="), f"constraints.txt: {line!r} is not name==version"
            key = canonicalize_name(name)
            assert key not in out, f"constraints.txt: {name!r} is pinned twice"
            out[key] = Version(version)
    return out


def test_every_direct_dependency_is_pinned_within_its_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    pinned = pins((REPO / "constraints.txt").read_text())
    # torch is installed by the Makefile's own pin (a CPU wheel here, a CUDA build elsewhere)
    checked = [r for r in wanted if canonicalize_name(r.name) != "torch"]
    assert len(checked) == len(wanted) - 1
    missing = [r.name for r in checked if canonicalize_name(r.name) not in pinned]
    assert missing == [], "run `make lock` after adding a dependency"
    outside = [(str(r), str(pinned[canonicalize_name(r.name)])) for r in checked
               if not r.specifier.contains(pinned[canonicalize_name(r.name)], prereleases=True)]
    assert outside == []
    assert "torch" not in pinned


def test_pins_reject_a_malformed_line():
    assert pins("# c\n\ngrpcio == 1.85.4  # x\nGRPCIO_tools==1.85.1\n") == {
        "grpcio": Version("1.85.4"), "grpcio-tools": Version("1.85.1")}
    for bad, message in [("grpcio>=1\n", "'grpcio>=1' is not name==version"),
                         ("grpcio===1\n", "'grpcio===1' is not name==version"),
                         ("grpcio==1\nGrpcio==2\n", "'Grpcio' is pinned twice")]:
        with pytest.raises(AssertionError, match=message):
            pins(bad)
