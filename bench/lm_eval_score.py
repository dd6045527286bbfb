"""Score lm-eval's multiple-choice requests in process from the model's own logits, and
compare with what lm-eval computed through the server (issue 36: the prompt logprobs are right
when lm-eval's accuracy equals this one, item by item).

Usage (the project's python; bench/clients.py runs it after lm-eval):
    python -m bench.lm_eval_score --samples SAMPLES.jsonl --checkpoint assets/dspark-small
        [--numerics fast|exact]
Prints one JSON line {"ok", "reason", "items", "acc_server", "acc_local", "max_abs_diff"}.

SAMPLES.jsonl is lm-eval's `--log_samples` file of a multiple_choice task: per document its
`arguments` (one (context, continuation) pair per choice, the strings lm-eval asked the
server to score), `resps` (the server's (log-likelihood, is-greedy) per choice), `target` and
`acc`. For each pair this module splits the tokens as lm-eval's `_encode_pair` does (trailing
spaces of the context move to the continuation; the continuation's tokens are those of
context + continuation past the context's own tokens; the tokenizer is the checkpoint
folder's, loaded with transformers, as lm-eval loads it), then runs the trunk the verifier
runs (`services.app.load_trunk`, the same numerics): prefill of the context, then one decode
per continuation token, and sums log_softmax(logits)[token] in float64 over the continuation.
The choice is the argmax (first on ties, as numpy's argmax in lm-eval). "ok" when every
item's choice and acc equal lm-eval's (so the accuracies are equal exactly).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) split as lm-eval's TemplateLM._encode_pair splits them;
    tok: a transformers tokenizer. Raises ValueError: the continuation has no tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    cont = whole[len(ctx):]
    if not cont:
        raise ValueError(f"continuation {continuation!r} has no tokens after context {context[-40:]!r}")
    return ctx, cont


def loglikelihood(trunk, ctx: list[int], cont: list[int]) -> float:
    """Sum over `cont` of log P(token | everything before it) from `trunk`'s logits (fp32
    log_softmax, summed in float64). Raises ValueError: empty ctx (no row predicts cont[0])."""
    if not ctx:
        raise ValueError("empty context: no logits row predicts the first continuation token")
    state = trunk.new_state()
    logits = trunk.prefill(state, ctx, taps=False).logits
    total = 0.0
    for i, token in enumerate(cont):
        total += float(torch.log_softmax(logits.float(), dim=-1)[token])
        if i + 1 < len(cont):
            logits = trunk.decode(state, token, len(ctx) + i, taps=False).logits
    return total


def compare(samples: list[dict], tok, trunk) -> dict:
    """The per-item comparison of lm-eval's samples with the in-process scores (module docstring)."""
    mismatches, diffs, acc_local, acc_server = [], [], 0, 0
    for doc in samples:
        pairs = [tuple(a[:2]) for a in doc["arguments"]]
        server = [float(r[0][0]) for r in doc["resps"]]
        local = [loglikelihood(trunk, *encode_pair(tok, c, x)) for c, x in pairs]
        diffs += [abs(a - b) for a, b in zip(server, local)]
        pick_server, pick_local = max(range(len(server)), key=server.__getitem__), max(range(len(local)),
                                                                                      key=local.__getitem__)
        target = int(doc["target"])
        acc_server += int(doc["acc"])
        acc_local += int(pick_local == target)
        if pick_server != pick_local or int(doc["acc"]) != int(pick_local == target):
            mismatches.append(doc["doc_id"])
    n = len(samples)
    ok = not mismatches and n > 0
    reason = (f"{n} items: lm-eval acc {acc_server}/{n} == in-process acc {acc_local}/{n}, every choice equal, "
              f"max |loglik diff| {max(diffs, default=0.0):.3g}" if ok else
              f"{n} items: choices differ on docs {mismatches}; lm-eval acc {acc_server}/{n}, in-process "
              f"{acc_local}/{n}, max |loglik diff| {max(diffs, default=0.0):.3g}")
    return {"ok": ok, "reason": reason, "items": n, "acc_server": acc_server / max(n, 1),
            "acc_local": acc_local / max(n, 1), "max_abs_diff": max(diffs, default=0.0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=Path, required=True, help="lm-eval's samples_<task>_*.jsonl")
    ap.add_argument("--checkpoint", type=Path, required=True, help="the served model's folder")
    ap.add_argument("--numerics", choices=("fast", "exact"), default="fast",
                    help="the verifier's DSPARK_VERIFY_NUMERICS (score with the same)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from services.app import load_trunk
    samples = [json.loads(line) for line in args.samples.read_text().splitlines() if line.strip()]
    tok = AutoTokenizer.from_pretrained(str(args.checkpoint))
    trunk = load_trunk(args.checkpoint, verify_numerics=args.numerics)
    with torch.inference_mode():
        result = compare(samples, tok, trunk)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
