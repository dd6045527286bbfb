"""bench/lm_eval_score.py reads lm-eval's samples and splits tokens the way lm-eval does (the
in-process half of the real-client multiple-choice check; bench/clients.py runs the rest).

The sample line is one lm-eval 0.4.13 wrote for bench/lm_eval_tasks/dspark_mc (its `doc` and
hashes left out); the tokenizer is the bundled folder's, loaded with transformers as lm-eval
loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bench.lm_eval_score import encode_pair, loglikelihood, requests

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "dspark-small"
CONTEXT = "import os\npath = os.path.join(root, name)\nif os.path."
SAMPLE = json.dumps({
    "doc_id": 0, "target": "0",
    "arguments": {f"gen_args_{i}": {"arg_0": CONTEXT, "arg_1": c}
                  for i, c in enumerate(["exists(path):", "banana(path):", "42(path):", "while path:"])},
    "resps": [[["-10.923450380563736", "False"]], [["-36.94513726234436", "False"]],
              [["-22.43523347377777", "False"]], [["-24.729800820350647", "False"]]],
    "filtered_resps": [["-10.923450380563736", "False"], ["-36.94513726234436", "False"],
                       ["-22.43523347377777", "False"], ["-24.729800820350647", "False"]],
    "filter": "none", "metrics": ["acc"], "acc": 1.0})


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(BUNDLED))


def test_requests_reads_the_choices_in_order_and_the_scores_exactly():
    pairs, scores = requests(json.loads(SAMPLE))
    assert pairs == [(CONTEXT, "exists(path):"), (CONTEXT, "banana(path):"), (CONTEXT, "42(path):"),
                     (CONTEXT, "while path:")]
    assert scores == [-10.923450380563736, -36.94513726234436, -22.43523347377777, -24.729800820350647]


def test_trailing_spaces_of_the_context_move_to_the_continuation(tok):
    ctx, cont = encode_pair(tok, "def add(a, b):\n    return ", "a + b")
    assert ctx == tok.encode("def add(a, b):\n    return", add_special_tokens=False)
    assert tok.decode(cont) == " a + b"


def test_a_token_across_the_boundary_is_split_as_lm_eval_sends_it(tok):
    # '(' + '"' is one token of the joined text: lm-eval sends the context's own ids and the
    # rest of the joined text's ids, which is not the joined text's tokenization
    ctx, cont = encode_pair(tok, "raise ValueError(", '"invalid value")')
    whole = tok.encode('raise ValueError("invalid value")', add_special_tokens=False)
    assert ctx == tok.encode("raise ValueError(", add_special_tokens=False)
    assert cont == whole[len(ctx):] and ctx + cont != whole


def test_an_empty_continuation_scores_zero_and_an_empty_context_is_refused():
    assert loglikelihood(None, [5, 6], []) == 0.0  # lm-eval's sum over no tokens; no forward needed
    with pytest.raises(ValueError, match="empty context"):
        loglikelihood(None, [], [5])
