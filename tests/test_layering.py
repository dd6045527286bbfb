"""The layering of the project's imports (tests/import_graph.py says what counts as an import):
no import circles, `kernels/` imports nothing of the project, and every import goes down the
layer order kernels < dsv4 < dspark_proto < services/common < services/{verifier | drafter |
gateway} < services/{http | analysis} < services' entry points < training < bench. The last
test shows each check failing on a deliberately broken copy of the sources."""

from __future__ import annotations

import functools

import pytest

from import_graph import circles, import_graph, project_sources, upward_imports

# No circle is allowed; an entry here would have to name one that exists (the test fails once
# it is gone), so an allowance cannot outlive its circle.
ALLOWED_CIRCLES: set[frozenset[str]] = set()


@functools.lru_cache(maxsize=None)
def sources() -> dict[str, str]:
    return project_sources()


@functools.lru_cache(maxsize=None)
def graph() -> dict[str, set[str]]:
    return import_graph(sources())


def test_the_graph_sees_the_imports_it_must():
    g = graph()
    # module level, inside a function (services.cli's subcommands), relative to a package
    assert "dsv4.trunk_jobs" in g["dsv4.trunk"]
    assert "services.analysis.cli" in g["services.cli"]
    assert "kernels.formats" in g["dsv4.codecs"] and "kernels.select" in g["dsv4.settings"]
    assert len(g) > 150 and sum(map(len, g.values())) > 500


def test_no_import_circles():
    found = set(circles(graph()))
    new = [sorted(c) for c in found - ALLOWED_CIRCLES]
    gone = [sorted(c) for c in ALLOWED_CIRCLES - found]
    assert not new, f"import circles: {new}"
    assert not gone, f"these circles no longer exist: delete them from ALLOWED_CIRCLES: {gone}"


def test_kernels_import_nothing_of_the_project():
    g = graph()
    outside = sorted((a, b) for a in g if a.split(".")[0] == "kernels" for b in g[a] if b.split(".")[0] != "kernels")
    assert outside == []


def test_every_import_goes_down_the_layer_order():
    assert upward_imports(graph()) == []


def broken(module: str, extra: str) -> dict[str, set[str]]:
    """The project's graph with `extra` appended to `module`'s source."""
    return import_graph({**sources(), module: sources()[module] + "\n" + extra + "\n"})


@pytest.mark.parametrize("module, extra, circle", [
    # a function-level import closing a circle inside the gateway
    ("services.gateway.backends", "def _later():\n    from services.gateway import scheduler\n",
     {"services.gateway.backends", "services.gateway.scheduler"}),
    # a type-only import back into the trunk
    ("dsv4.trunk_jobs", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .trunk import Trunk\n",
     {"dsv4.trunk", "dsv4.trunk_jobs"}),
])
def test_a_deliberate_circle_fails_the_check(module, extra, circle):
    found = circles(broken(module, extra))
    assert any(circle <= c for c in found), found
    assert set(found) - ALLOWED_CIRCLES


def test_a_deliberate_upward_import_fails_the_checks():
    g = broken("kernels.checks", "import dsv4.config")
    assert ("kernels.checks", "dsv4.config") in upward_imports(g)
    g = broken("services.gateway.gate", "from services.verifier import engine")  # a sibling, not below
    assert upward_imports(g) == [("services.gateway.gate", "services.verifier.engine")]
