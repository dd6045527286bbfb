"""Multiple-choice scoring through the HTTP API, the way lm-eval scores it, against the same task
scored in process from the model's own logits (issue 36: prompt logprobs must be exact).

Starts the three services in process on port 0 (exact verifier numerics by default; the
bundled model unless `--checkpoint ""` picks the random tiny one) and the HTTP front, then for
a small local multiple-choice task (`TASK`: a context and four continuations each, the first
one the answer) sends lm-eval's loglikelihood request through the `openai` client, one batch
of every (context, continuation) of an item, exactly as lm-eval's `local-completions` model
does: `{"prompt": [[ids...], ...], "max_tokens": 1, "logprobs": 1, "echo": true,
"temperature": 0, "seed": 1234}`, and reads the reply as its `parse_logprobs` does (the sum of
`token_logprobs[ctxlen:-1]`). The same scores are computed in process: one `Trunk` prefill
of the whole sequence with the logits of every row, the log-softmax of each row at the next
token. Prints each item's chosen answer both ways, both accuracies, and the largest score
difference (0 in exact numerics: bitwise equal).

    python -m bench.prompt_scoring                    # bundled model, exact numerics
    python -m bench.prompt_scoring --numerics fast    # differences to rounding

Nothing is asserted (tests/test_prompt_logprobs.py holds the properties).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import openai

from dsv4.batch import BatchItem
from services import app
from services.common.settings import BackendSettings, GatewaySettings
from services.gateway.gate import GateConfig
from services.http.server import model_id, start_http_front

# (context, continuations): the first continuation is the answer.
TASK = [
    ("def add(a, b):\n    return", [" a + b", " a * b", " a - b", " b / a"]),
    ("for i in range(10):\n    print(", ["i)", "x)", "range)", "10]"]),
    ("import numpy as", [" np", " pd", " plt", " os"]),
    ("if __name__ == ", ['"__main__":', '"main":', "__name__:", "True:"]),
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"]),
    ("x = [1, 2, 3]\nprint(len(x))  # prints", [" 3", " 4", " 2", " 1"]),
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y =", [" y", " x", " 0", " self"]),
    ("while True:\n    line = input()\n    if not line:\n        ", ["break", "return", "pass", "yield"]),
]
SEED = 1234  # what lm-eval sends


async def _start(checkpoint: str | None, numerics: str):
    backend = BackendSettings(verify_numerics=numerics)
    trunk = app.load_trunk(checkpoint, verify_numerics=numerics)
    verifier = await app.start_verifier(app.verifier_engine(trunk, backend))
    settings = GatewaySettings(verifier_target=f"127.0.0.1:{verifier.port}", drafter_target="",
                               verify_mode="batched")
    gateway, scheduler, backends = await app.start_gateway(settings, GateConfig(), checkpoint=checkpoint)
    front = await start_http_front(gateway, scheduler, checkpoint, 0, generate_timeout_s=300)
    stops = [lambda: front.http.stop(1.0), backends.close, lambda: gateway.stop(0), lambda: verifier.stop(0)]
    return trunk, scheduler.tokenizer, front, stops


def in_process(trunk, ids: list[int], ctxlen: int) -> float:
    """The continuation's summed logprob from one prefill of the whole sequence: row t's
    log-softmax at token t + 1, for the continuation's tokens."""
    out = trunk.forward_batch([BatchItem.prefill_chunk(trunk.new_state(), ids, 0, None, all_logits=True)])[0]
    lp = out.prompt_logits.float().log_softmax(-1)  # [S, V]
    return sum(float(lp[t - 1, ids[t]]) for t in range(ctxlen, len(ids)))


def via_http(client: openai.OpenAI, model: str, sequences: list[list[int]], ctxlen: int) -> list[float]:
    """lm-eval's request and parse (`parse_logprobs`): one batch of the item's sequences."""
    r = client.completions.create(model=model, prompt=sequences, max_tokens=1, logprobs=1, echo=True,
                                  temperature=0, seed=SEED)
    return [sum(c.logprobs.token_logprobs[ctxlen:-1]) for c in sorted(r.choices, key=lambda c: c.index)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="assets/dspark-small", help='"" for the random tiny model')
    ap.add_argument("--numerics", choices=("exact", "fast"), default="exact")
    args = ap.parse_args()
    checkpoint = args.checkpoint or None
    loop = asyncio.new_event_loop()
    trunk, tokenizer, front, stops = loop.run_until_complete(_start(checkpoint, args.numerics))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{front.http.port}/v1", api_key="unused", max_retries=0,
                           timeout=300)
    served = model_id(checkpoint)
    right = {"http": 0, "in_process": 0}
    worst = 0.0
    t0 = time.perf_counter()
    try:
        for context, continuations in TASK:
            ctx = tokenizer.encode(context)
            sequences = [ctx + tokenizer.encode(context + c)[len(ctx):] for c in continuations]
            # lm-eval's request runs on the event loop's thread pool: the server lives on `loop`
            http = loop.run_until_complete(asyncio.to_thread(via_http, client, served, sequences, len(ctx)))
            local = [in_process(trunk, s, len(ctx)) for s in sequences]
            worst = max(worst, *(abs(a - b) for a, b in zip(http, local)))
            picks = {"http": max(range(4), key=http.__getitem__), "in_process": max(range(4), key=local.__getitem__)}
            for way, pick in picks.items():
                right[way] += pick == 0
            print(f"{context[:40]!r:44} http pick {picks['http']}  in-process pick {picks['in_process']}  "
                  f"answer score {http[0]:.6f} / {local[0]:.6f}")
    finally:
        for stop in stops:
            loop.run_until_complete(stop())
    n = len(TASK)
    print(f"\n{args.numerics} numerics, {served}: accuracy via HTTP {right['http']}/{n}, in process "
          f"{right['in_process']}/{n}; largest |score difference| {worst:.3g} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
