"""The settings declarations (`services.settings_vars`): the generated reference is current,
every variable a parser reads is declared, the deprecated names work and warn once, and the
README's and docs' relative links resolve."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from services import settings_doc, settings_vars
from services.settings import client_token, read_settings
from services.settings_vars import BY_NAME, REMOVED, VARS

REPO = Path(__file__).resolve().parents[1]


class Recorder(dict):
    """An environment that records every name a parser asks about."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)


def test_docs_settings_md_and_the_readme_block_are_current():
    assert settings_doc.main(["--check"]) == 0, "run: make settings-doc (python -m services.settings_doc)"


def test_every_variable_read_is_declared_and_read_by_the_processes_it_names():
    known = set(BY_NAME) | {old for v in VARS for old in v.aliases} | set(REMOVED)
    read_somewhere = set()
    for service in ("verifier", "drafter", "gateway"):
        env = Recorder({"DSPARK_TOPK_DIAG": "0"})
        read_settings(env, service)
        assert env.asked - known == set(), f"{service} reads undeclared variables"
        assert {v.name for v in VARS if service in v.readers} <= env.asked, service
        read_somewhere |= env.asked
    assert set(BY_NAME) <= read_somewhere  # nothing declared that no service reads
    env = Recorder()
    client_token(None, env)
    assert env.asked == {v.name for v in VARS if "generate" in v.readers}


def test_one_prefix_and_the_reasoned_exceptions():
    names = [v.name for v in VARS]
    assert len(names) == len(set(names)) == 50  # 51 until DSPARK_GATE_MIN_DRAFT was cut (issue #38: no measurement supported it)
    assert [n for n in names if not n.startswith("DSPARK_")] == ["OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME"]
    assert sum(v.key for v in VARS) == 6
    assert sum(len(v.aliases) for v in VARS) == 15  # 16 with DEEPSEEK_DSPARK_GATE_MIN_DRAFT


def test_declared_defaults_are_what_a_served_process_gets():
    verifier, gateway = read_settings({}, "verifier"), read_settings({}, "gateway")
    assert verifier.tp.init_timeout_s == BY_NAME["DSPARK_TP_INIT_TIMEOUT_S"].default == 600.0
    assert verifier.backend.step_gather_ms == BY_NAME["DSPARK_STEP_GATHER_MS"].default
    assert gateway.gateway.cost_mode == BY_NAME["DSPARK_GATE_COSTS"].default == "measured"
    from services.verifier.topk_diag import ENV_DIR, ENV_K, MAX_K
    from services.verifier.tp import ENV_CALL_TIMEOUT, ENV_INIT_TIMEOUT, TPSettings
    assert (TPSettings().init_timeout_s, TPSettings().call_timeout_s) == (600.0, 120.0)
    assert settings_vars.MAX_TOPK == MAX_K
    # the names the verifier's errors use are the declared ones
    assert {ENV_DIR, ENV_K, ENV_CALL_TIMEOUT, ENV_INIT_TIMEOUT} <= set(BY_NAME)


def test_a_deprecated_name_is_read_and_warns_once_per_process(caplog, monkeypatch):
    monkeypatch.setattr(settings_vars, "_warned", set())
    env = {"DEEPSEEK_DSPARK_GATE": "1", "DEEPSEEK_DSPARK_GATE_DECAY": "0.5", "DSV4_KERNELS": "triton"}
    with caplog.at_level(logging.WARNING, logger="services.settings_vars"):
        first = read_settings(env, "gateway")
        read_settings(env, "gateway")
        model = read_settings(env, "verifier").model
    assert first.gate.enabled is True and first.gate.decay == 0.5 and model.kernels == "triton"
    warned = [r.getMessage().split(" ")[0] for r in caplog.records]
    assert sorted(warned) == ["DEEPSEEK_DSPARK_GATE", "DEEPSEEK_DSPARK_GATE_DECAY", "DSV4_KERNELS"]
    assert "set DSPARK_GATE_DECAY instead" in caplog.text


def test_an_error_names_the_deprecated_name_as_set_and_disagreeing_names_are_refused(monkeypatch):
    monkeypatch.setattr(settings_vars, "_warned", set())
    with pytest.raises(ValueError, match=r"^DSV4_TP_CALL_TIMEOUT_S='x': not a number"):
        read_settings({"DSV4_TP_CALL_TIMEOUT_S": "x"}, "verifier")
    with pytest.raises(ValueError, match=r"DSPARK_GATE_MARGIN='2' and its deprecated alias "
                                         r"DEEPSEEK_DSPARK_GATE_MARGIN='3' disagree"):
        read_settings({"DSPARK_GATE_MARGIN": "2", "DEEPSEEK_DSPARK_GATE_MARGIN": "3"}, "gateway")
    same = read_settings({"DSPARK_GATE_MARGIN": "2", "DEEPSEEK_DSPARK_GATE_MARGIN": "2"}, "gateway")
    assert same.gate.win_factor == 2.0


def test_a_removed_variable_changes_nothing_and_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(settings_vars, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="services.settings_vars"):
        gateway = read_settings({"DSPARK_GATE_REGIME": "0"}, "gateway").gateway
        read_settings({"DSPARK_GATE_REGIME": "0"}, "gateway")
    assert gateway.regime is True
    assert [r.getMessage() for r in caplog.records] == [
        "DSPARK_GATE_REGIME is no longer read and has no effect: the model regime (docs/gate.md §14) always runs "
        "(GatewaySettings.regime)"]


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_of_the_readme_and_docs_resolve():
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in _LINK.findall(doc.read_text(encoding="utf-8")):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert broken == []


def test_every_doc_opens_with_who_it_is_for():
    for doc in sorted((REPO / "docs").glob("*.md")):
        lines = doc.read_text(encoding="utf-8").splitlines()
        assert lines[0].startswith("# ") and lines[2].startswith("For "), doc.name
