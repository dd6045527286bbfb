"""Logits controls through the services in exact numerics (docs/sampling.md): with every control
and a combination, speculative output (always and gated) equals plain decode token for token,
greedy and seeded; a -100 bias bans a token, +100 forces one; min_tokens holds eos and the stop
token ids off; bad values are refused naming the field; and the same through the `openai`
package over HTTP.

Real servers on port 0: a verifier with DSPARK_VERIFY_NUMERICS=exact, the live oracle drafter
corrupting every third slot (so drafts are rejected as well as accepted) or the DSpark drafter,
the gateway (batched verify) and its HTTP front. The per-control grid is `slow`."""

from __future__ import annotations

import itertools
import json

import grpc
import openai
import pytest

from services.http.server import RANDOM_MODEL_ID as MODEL, start_http_front
from services_fixtures import (ServiceStack, dspark_exact, gen_request, oracle_exact,  # noqa: F401 (fixtures)
                               tiny_tokenizer)

PROMPT = "the quick brown fox"
EOS = 1
TIMEOUT_S = 120.0
# Controls by name, as GenerateRequest fields. "repeat" is a penalty that changes the tokens
# of this prompt (the random model repeats once rewarded for it); "mix" is every control at once.
CONTROLS = {
    "repeat": {"presence_penalty": -2.0, "frequency_penalty": -1.0},
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 2.0},
    "repetition": {"repetition_penalty": 3.0},
    "bias": {"logit_bias": {100: 6.0, 116: -100.0}},
    "bad_words": {"bad_words": ["2r", "9"]},
    "mix": {"logit_bias": {100: 4.0, 59: -100.0}, "frequency_penalty": 1.5, "presence_penalty": -0.5,
            "repetition_penalty": 1.3, "min_tokens": 6, "bad_words": ["2r"], "ignore_eos": False},
}


def request(spec: str, temperature: float = 0.0, max_tokens: int = 16, seed: int = 5, rule: int = 0, **controls):
    req = gen_request(PROMPT, max_tokens=max_tokens, spec=spec, temperature=temperature,
                      ignore_eos=controls.pop("ignore_eos", True))
    if temperature > 0:
        req.seed, req.sampling_rule = seed, rule
    for name, value in controls.items():
        if name == "logit_bias":
            req.logit_bias.update(value)
        elif name in ("bad_words", "stop_token_ids"):
            getattr(req, name).extend(value)
        else:
            setattr(req, name, value)
    return req


def check_speculation_equals_plain(stack: ServiceStack, temperature: float, controls: dict,
                                   specs=("always", "gated"), modes=("batched",), stats: bool = False):
    """Plain decode's tokens under `controls`, after checking every spec and verify mode gives
    exactly them. Returns them (stats: and the first speculative run's SpecStats)."""
    plain = stack.generate(request("off", temperature, **controls), "batched")
    first = None
    for spec, mode in itertools.product(specs, modes):
        got = stack.generate(request(spec, temperature, **controls), mode)
        assert got.token_ids == plain.token_ids, (controls, temperature, spec, mode)
        assert got.final.finish_reason == plain.final.finish_reason
        first = first or got.final.spec_stats
    return (plain.token_ids, first) if stats else plain.token_ids


def test_penalties_and_a_mix_of_every_control_keep_speculation_exact(oracle_exact):
    """Seeded: a penalty that changes the tokens and every control at once; greedy: the mix."""
    free = oracle_exact.generate(request("off", 0.8), "batched").token_ids
    repeat = check_speculation_equals_plain(oracle_exact, 0.8, CONTROLS["repeat"])
    assert repeat != free  # the penalty changes the tokens: the equality above is not vacuous
    for t in (0.8, 0.0):
        mix, stats = check_speculation_equals_plain(oracle_exact, t, CONTROLS["mix"], stats=True)
        assert mix != free and 59 not in mix and EOS not in mix[:6]
        assert not any(a == 52 and b == 116 for a, b in zip(mix, mix[1:]))  # the bad word "2r"
        assert 0 < stats.accepted < stats.submitted  # drafts accepted and rejected under the controls


def test_a_banned_token_never_appears_and_a_forced_one_always_does(oracle_exact):
    free = oracle_exact.generate(request("always", 0.8), "batched").token_ids
    banned = max(set(free), key=free.count)  # the plain run's most frequent token
    out = oracle_exact.generate(request("always", 0.8, logit_bias={banned: -100.0}), "batched").token_ids
    assert banned not in out and len(out) == 16
    forced = oracle_exact.generate(request("gated", 0.8, max_tokens=8, logit_bias={300: 100.0}), "batched")
    assert forced.token_ids == [300] * 8


def test_min_tokens_holds_eos_and_stop_ids_off(oracle_exact):
    eos_first = {"logit_bias": {EOS: 100.0}, "ignore_eos": False}  # eos is the top choice everywhere
    assert oracle_exact.generate(request("always", **eos_first), "batched").token_ids == [EOS]
    held = check_speculation_equals_plain(oracle_exact, 0.8, eos_first | {"min_tokens": 5})
    assert len(held) == 6 and held[-1] == EOS and EOS not in held[:5]
    stop = {"logit_bias": {300: 100.0}, "stop_token_ids": [300], "min_tokens": 3}
    out = oracle_exact.generate(request("always", **stop), "batched")
    assert out.token_ids[-1] == 300 and 300 not in out.token_ids[:3] and len(out.token_ids) == 4
    assert out.final.finish_reason == "stop" and out.final.matched_token_id == 300


def test_min_tokens_holds_stop_strings_off_with_ignore_eos(oracle_exact):
    """Found by the adversarial pass: with ignore_eos, no stop_token_ids and no other control,
    min_tokens masks no token, so the controls were dropped as neutral and the stop strings
    were looked for from the first token: `min_tokens` 4 stopped after 1 token."""
    plain = oracle_exact.generate(request("off"), "batched").token_ids
    # a non-byte id decodes to "<id>" (ByteTokenizer): ">" would stop among the first 4 tokens
    assert ">" in tiny_tokenizer().decode(plain[:4]), plain
    for spec in ("off", "always"):
        req = request(spec, min_tokens=4)
        req.stop.append(">")
        out = oracle_exact.generate(req, "batched")
        assert len(out.token_ids) > 4 and out.token_ids == plain[:len(out.token_ids)], out.token_ids
        assert out.final.finish_reason == "stop"


def test_dspark_drafter_drafts_under_the_controls(dspark_exact):
    """The DSpark drafter's own slots (DraftSampler under DraftGuide): coupled output equals
    plain; under the rejection rule (lossless in distribution, not bitwise) a banned token
    still never appears."""
    check_speculation_equals_plain(dspark_exact, 0.8, CONTROLS["mix"], specs=("always",))
    out = dspark_exact.generate(request("always", 1.0, max_tokens=24, rule=2, logit_bias={100: 8.0, 127: -100.0},
                                        frequency_penalty=2.0), "batched")
    assert 127 not in out.token_ids and out.token_ids.count(100) >= 2 and out.final.spec_stats.submitted > 0


@pytest.mark.parametrize("fields, words", [
    ({"logit_bias": {512: 1.0}}, "logit_bias key 512 outside [0, vocab_size=512)"),
    ({"logit_bias": {5: 100.5}}, "logit_bias[5]=100.5: must lie in [-100, 100]"),
    ({"presence_penalty": float("nan")}, "presence_penalty=nan: must be a finite number"),
    ({"frequency_penalty": -2.5}, "frequency_penalty=-2.5: must lie in [-2, 2]"),
    ({"repetition_penalty": -1.0}, "repetition_penalty=-1: must be > 0"),
    ({"min_tokens": 30}, "min_tokens=30: must be <= max_tokens=16"),
    ({"bad_words": [" "]}, "bad_words[0]=' ': must hold text"),
])
def test_bad_controls_are_invalid_argument_naming_the_field(oracle_exact, fields, words):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        oracle_exact.generate(request("always", **fields), "batched")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


# ---------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def http_client(oracle_exact):
    gw = oracle_exact.gateway("batched")
    http = oracle_exact.loop.run(start_http_front(gw.server, gw.scheduler, None, 0, generate_timeout_s=TIMEOUT_S))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{http.http.port}/v1", api_key="unused", max_retries=0,
                        timeout=TIMEOUT_S), gw
    oracle_exact.loop.run(http.http.stop(1.0))


def test_openai_client_controls_equal_the_grpc_request(oracle_exact, http_client):
    client, gw = http_client
    mix = CONTROLS["mix"]
    body = {"logit_bias": {str(k): v for k, v in mix["logit_bias"].items()}, "frequency_penalty": mix["frequency_penalty"],
            "presence_penalty": mix["presence_penalty"], "seed": 5, "temperature": 0.8}
    extra = {"repetition_penalty": mix["repetition_penalty"], "min_tokens": mix["min_tokens"],
             "bad_words": mix["bad_words"], "spec": "gated", "return_token_ids": True}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, extra_body=extra, **body)
    tokens = out.choices[0].model_extra["token_ids"]
    want = oracle_exact.generate(request("off", 0.8, **mix), "batched").token_ids
    assert tokens == want and 59 not in tokens


@pytest.mark.parametrize("extra, param, words", [
    ({"logit_bias": {"5": -101}}, "logit_bias", "logit_bias[5]=-101: must lie in [-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias key 'x': must be a token id"),
    # non-ASCII digits (str.isdigit() holds for them, int() refuses "²"): were a 500
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "logit_bias key '\u00b2': must be a token id"),
    ({"logit_bias": {"\u0663": 1}}, "logit_bias", "logit_bias key '\u0663': must be a token id"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty=3: must lie in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty=0: must be > 0"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens"),
    # the gateway's refusals (INVALID_ARGUMENT) name their field as `param` too
    ({"min_tokens": 9}, "min_tokens", "min_tokens=9: must be <= max_tokens=4"),
    ({"bad_words": ["ab" * 40]}, "bad_words", "bad_words: a word of 80 tokens; each needs 1..32"),
])
def test_openai_client_bad_controls_are_400_naming_the_field(http_client, extra, param, words):
    client, _ = http_client
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert err.value.status_code == 400 and err.value.param == param and words in err.value.message


# ---------------------------------------------------------------------------- slow grid
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_every_control_keeps_speculation_exact_sequential_and_batched(oracle_exact, dspark_exact, name):
    for stack, t in itertools.product((oracle_exact, dspark_exact), (0.0, 0.8)):
        check_speculation_equals_plain(stack, t, CONTROLS[name], modes=("batched", "sequential"))


def test_dspark_generate_flags(oracle_exact, capsys):
    from services.cli import main
    gw = oracle_exact.gateway("batched")
    args = ["generate", PROMPT, "--target", gw.target, "--max-tokens", "6", "--spec", "always", "--ignore-eos",
            "--json", "--timeout", "60"]
    assert main(args + ["--logit-bias", "300=100", "--frequency-penalty", "0.5", "--bad-word", "x"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t for m in lines for t in m.get("token_ids", [])] == [300] * 6
    assert main(args + ["--logit-bias", "300:1"]) == 2
    assert "--logit-bias='300:1': must be ID=BIAS" in capsys.readouterr().err
    assert main(args + ["--presence-penalty", "3"]) == 1
    assert "presence_penalty=3: must lie in [-2, 2]" in capsys.readouterr().err


def test_controls_inside_a_grammar_keep_speculation_exact(oracle_exact):
    """The grammar mask after the controls, one per-row hook on both sides: a bias toward a
    letter the regex allows, a penalty against repeating it, min_tokens inside the grammar."""
    controls = {"logit_bias": {ord("q") + 2: 5.0}, "frequency_penalty": 2.0, "min_tokens": 3, "ignore_eos": False}
    outs = []
    for spec in ("off", "always"):
        req = request(spec, 0.8, max_tokens=24, **controls)
        req.constraint.regex = "[a-z]{2,8}"
        outs.append(oracle_exact.generate(req, "batched"))
    text = outs[0].final.text
    assert outs[0].token_ids == outs[1].token_ids and 2 <= len(text) <= 8 and text.isalpha() and "q" in text
    assert outs[0].final.finish_reason == "stop"
