"""Score lm-eval's multiple-choice requests in process from the model's own logits, and
compare with what lm-eval computed through the server (issue 36: the prompt logprobs are right
when lm-eval's accuracy equals this one, item by item).

Usage (the project's python; bench/clients.py runs it after lm-eval):
    python -m bench.lm_eval_score --samples SAMPLES.jsonl --checkpoint assets/dspark-small
        [--numerics fast|exact]
Prints one JSON line {"ok", "reason", "items", "acc_server", "acc_local", "max_abs_diff"}.

SAMPLES.jsonl is lm-eval's `--log_samples` file of a multiple_choice task: per document its
`arguments` (one (context, continuation) pair per choice, the strings lm-eval asked the
server to score), `filtered_resps` (the (log-likelihood, is-greedy) lm-eval read from the
server's echo logprobs, per choice), `target` and `acc`. For each pair this module splits the tokens as lm-eval's `_encode_pair` does (trailing
spaces of the context move to the continuation; the continuation's tokens are those of
context + continuation past the context's own tokens; the tokenizer is the checkpoint
folder's, loaded with transformers, as lm-eval loads it), then runs the trunk the verifier
runs (`services.app.load_trunk`, the same numerics), one sequence at a time, no batching
(`loglikelihood`), and sums log_softmax(logits)[token] in float64 over the continuation.
The choice is the argmax (first on ties, as numpy's argmax in lm-eval). "ok" when every
item's choice and acc equal lm-eval's (so the accuracies are equal exactly).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dsv4.numerics import EXACT_ROWS


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) split as lm-eval's TemplateLM._encode_pair splits them;
    tok: a transformers tokenizer. lm-eval sends context ids + continuation ids, which is not
    always the tokenization of the joined text (a token spanning the boundary), and so does
    this module. The continuation's ids may be empty (its text merged into the context's last
    token); lm-eval then scores it 0.0."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def loglikelihood(trunk, ctx: list[int], cont: list[int]) -> float:
    """Sum over `cont` of log P(token | everything before it) from `trunk`'s logits (fp32
    log_softmax, summed in float64); 0.0 for an empty `cont` (lm-eval's sum over no tokens).

    The rows come from a prefill of ctx[:-1] and one verify block [ctx[-1], *cont] (row j
    predicts cont[j]): in exact numerics bitwise what one decode per token gives
    (`Trunk.forward_block`), at a fraction of the cost; a context of one token, or a block
    longer than the exact-mode limit, decodes token by token instead.
    Raises ValueError: empty ctx (no row predicts cont[0])."""
    if not ctx:
        raise ValueError("empty context: no logits row predicts the first continuation token")
    if not cont:
        return 0.0
    state = trunk.new_state()
    if len(ctx) >= 2 and len(cont) + 1 <= EXACT_ROWS:
        trunk.prefill(state, ctx[:-1], taps=False)
        rows = trunk.forward_block(state, [ctx[-1], *cont], len(ctx) - 1).logits[:len(cont)]
    else:
        logits = [trunk.prefill(state, ctx, taps=False).logits]
        for i, token in enumerate(cont[:-1]):
            logits.append(trunk.decode(state, token, len(ctx) + i, taps=False).logits)
        rows = torch.stack(logits)
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    return sum(float(logprobs[j, token]) for j, token in enumerate(cont))


def requests(doc: dict) -> tuple[list[tuple[str, str]], list[float]]:
    """One logged document's (context, continuation) per choice, in choice order, and the
    log-likelihood lm-eval computed for each from the server's reply. lm-eval 0.4.13 logs
    `arguments` as {"gen_args_<i>": {"arg_0": context, "arg_1": continuation}} and each of
    `filtered_resps` as [str(loglikelihood), str(is_greedy)] (repr of the float: exact).
    Raises KeyError / ValueError: another layout."""
    args = doc["arguments"]
    if isinstance(args, dict):
        ordered = [args[f"gen_args_{i}"] for i in range(len(args))]
        pairs = [(a["arg_0"], a["arg_1"]) for a in ordered]
    else:  # older lm-eval: a list of [context, continuation]
        pairs = [(a[0], a[1]) for a in args]
    return pairs, [float(r[0]) for r in doc["filtered_resps"]]


def compare(samples: list[dict], tok, trunk) -> dict:
    """The per-item comparison of lm-eval's samples with the in-process scores (module docstring)."""
    mismatches, diffs, acc_local, acc_server = [], [], 0, 0
    for doc in samples:
        pairs, server = requests(doc)
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
