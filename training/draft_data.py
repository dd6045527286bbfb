"""The DSpark draft's training data: the exported trunk's own greedy continuations.

Owns the draft's training sequences (ids, tap rows, the trunk's top-K distributions) and
their shard files; it reads the trunk only through the verifier's loader and never trains.

    python -m training.draft_data --checkpoint assets/dspark-small --out runs/draft/data/final \
        --split train --sequences 200 --shard 0 --of 2            # one of two processes

The trunk is read through `dsv4.checkpoint.load_trunk_weights` (the verifier's loader), so the
draft learns exactly the model the verifier runs. Per sequence: a prompt of `--prompt-min`..
`--prompt-max` tokens cut at a random offset of one domain's tokenized stream (the domain
drawn by `--mix`; no bos is added, as the gateway adds none), then a prefill of the prompt
and `--new` greedy decode steps.

Generation runs `--batch` sequences at once (`continue_greedy_batch`): one
`Trunk.forward_batch` pass prefills every prompt of the group, then each pass decodes the
next token of every sequence, so the dense ops and experts run once per step over all rows
instead of once per sequence. Under `--numerics exact` (the default) a row is bitwise the same
alone or in any batch (`dsv4.numerics.ExactNumerics`), so a shard's contents do not depend on
`--batch`: batched generation equals the one-at-a-time `continue_greedy` exactly (a test
holds them equal). `--numerics fast` is equal to rounding only, and a near-tie may then pick
another greedy token. Stored per sequence:

* ids [S] int64: prompt + greedy continuation (S = P + new);
* taps [S, T*D] fp32: the DSpark tap rows (lane mean of the target layers) of every
  position, from the prefill (prompt) and the decode steps (prefill and decode compute the
  same rows, `Trunk` docstring);
* top_ix / top_lp [new, K]: the trunk's top-K token ids and log-probabilities at positions
  P-1..S-2 (the distributions of the continuation tokens P..S-1; K = `--topk`), for the
  total-variation loss; the argmax is the next token (greedy).

Output: `<out>/{split}_shard{i}of{n}.pt` = {"meta": ..., "seqs": [dict, ...]} rewritten
atomically at most every `--save-every-s` seconds (and at the end), so a killed run keeps what
it made and `--resume` continues it. (A shard of thousands of sequences is gigabytes of tap
rows; rewriting it after every group would write tens of gigabytes.)
Sequence k of shard i is a pure function of (seed, split, i + k * n), so shards never overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from dsv4.batch import BatchItem
from dsv4.checkpoint import load_trunk_weights
from dsv4.trunk import Trunk
from training.tokenizer import BOS_ID as BOS, EOS_ID as EOS

DOMAINS = ("code", "prose", "math", "repeat")
DEFAULT_MIX = {"code": 0.35, "prose": 0.15, "math": 0.2, "repeat": 0.3}


def load_trunk(checkpoint: str | Path, numerics: str = "fast") -> Trunk:
    """The verifier's trunk (fp32) from a checkpoint folder, with verify numerics `numerics`
    ("fast" | "exact"; exact pins the thread count current at this call).

    Raises:
        ValueError: numerics not "fast" / "exact" (from `Trunk`).
        dsv4.checkpoint.CheckpointError: a missing or unreadable trunk tensor.
    """
    cfg, weights = load_trunk_weights(checkpoint)
    trunk = Trunk(cfg, verify_numerics=numerics)
    trunk.load_weights(weights)
    return trunk


def document_starts(streams: dict[str, np.ndarray], bos: int = BOS) -> dict[str, np.ndarray]:
    """Domain -> offsets [n_docs] int64 of each document's first token (the one after its bos)."""
    return {d: np.flatnonzero(np.asarray(s) == bos) + 1 for d, s in streams.items()}


def sample_prompt(streams: dict[str, np.ndarray], mix: dict[str, float], seed: int, split: str, index: int,
                  prompt_min: int, prompt_max: int, doc_start: float = 0.0,
                  starts: dict[str, np.ndarray] | None = None) -> tuple[str, torch.Tensor]:
    """(domain, prompt ids [P]) of sequence `index`, a pure function of the arguments.

    With probability `doc_start` the prompt begins a random document (`starts`, from
    `document_starts`) and ends before that document's eos (at least 2 tokens); otherwise it
    is cut at a random offset (it may then span documents).
    """
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
    names = [d for d in DOMAINS if mix.get(d, 0) > 0]
    p = np.array([mix[d] for d in names], dtype=np.float64)
    d = names[int(rng.choice(len(names), p=p / p.sum()))]
    n = int(rng.integers(prompt_min, prompt_max + 1))
    s = streams[d]
    at_start = doc_start > 0 and rng.random() < doc_start  # no draw at 0: the old prompts stay
    if at_start and starts is not None and len(starts[d]):
        off = int(starts[d][int(rng.integers(0, len(starts[d])))])
        ids = np.asarray(s[off:off + n], dtype=np.int64)
        ends = np.flatnonzero(ids == EOS)
        if len(ends) and ends[0] >= 2:
            ids = ids[:ends[0]]
        if len(ids) >= 2 and not (ids == EOS).any():
            return d, torch.from_numpy(ids)
    off = int(rng.integers(0, len(s) - n))
    return d, torch.from_numpy(np.asarray(s[off:off + n], dtype=np.int64))


@torch.no_grad()
def continue_greedy(trunk: Trunk, prompt: torch.Tensor, new: int, topk: int) -> dict[str, torch.Tensor]:
    """Prefill `prompt` [P] and decode `new` greedy tokens; see the module docstring for the fields."""
    P = prompt.shape[0]
    st = trunk.new_state()
    out = trunk.prefill(st, prompt, keep_rows=P)
    taps, lps = [out.taps], []
    ids = prompt.tolist()
    logits = out.logits
    for pos in range(P, P + new):
        lps.append(torch.log_softmax(logits.float(), -1))
        token = int(logits.argmax())
        ids.append(token)
        if pos == P + new - 1:
            break
        out = trunk.decode(st, token, pos)
        taps.append(out.taps)
        logits = out.logits
    # The last token's tap row: one more decode step (its logits are not needed).
    out = trunk.decode(st, ids[-1], P + new - 1)
    taps.append(out.taps)
    return _sequence(ids, P, taps, lps, topk)


def _sequence(ids: list[int], prompt_len: int, taps: list[torch.Tensor], lps: list[torch.Tensor],
              topk: int) -> dict[str, torch.Tensor | int]:
    """One stored sequence (module docstring) from its ids, tap row blocks [*, T*D] and
    per-step log-probabilities [V] fp32."""
    top_lp, top_ix = torch.stack(lps).topk(topk, dim=-1)  # [new, K]
    return {"ids": torch.tensor(ids, dtype=torch.int64), "prompt_len": prompt_len, "taps": torch.cat(taps).float(),
            "top_ix": top_ix.to(torch.int16), "top_lp": top_lp.to(torch.float32)}


@torch.no_grad()
def continue_greedy_batch(trunk: Trunk, prompts: list[torch.Tensor], new: int,
                          topk: int) -> list[dict[str, torch.Tensor | int]]:
    """`continue_greedy` of every prompt [P_b] int64 at once, through `Trunk.forward_batch`.

    One pass prefills every prompt (tap rows of all P_b positions), then `new` passes each
    decode one token per sequence at its own position P_b + t (prompt lengths may differ).
    Returns one dict per prompt, in order, with the fields of `continue_greedy`; under exact
    verify numerics they are bitwise those of `continue_greedy`.
    Raises:
        ValueError: no prompts, new < 1, or a prompt + new past max_seq_len (the prompt's
            index and length named); `Trunk.forward_batch` names bad token ids.
    """
    if not prompts or new < 1:
        raise ValueError(f"need at least one prompt and new >= 1, got {len(prompts)} prompts, new={new}")
    for b, p in enumerate(prompts):
        if p.ndim != 1 or p.numel() == 0 or p.numel() + new > trunk.cfg.max_seq_len:
            raise ValueError(f"prompt {b}: length {tuple(p.shape)} + new={new} must fit "
                             f"1..max_seq_len={trunk.cfg.max_seq_len} positions")
    states = [trunk.new_state() for _ in prompts]
    outs = trunk.forward_batch([BatchItem.prefill_chunk(st, p, 0, p.shape[0]) for st, p in zip(states, prompts)])
    ids = [p.tolist() for p in prompts]
    taps: list[list[torch.Tensor]] = [[o.taps] for o in outs]
    lps: list[list[torch.Tensor]] = [[] for _ in prompts]
    for t in range(new):
        for b, o in enumerate(outs):
            lps[b].append(torch.log_softmax(o.logits.float(), -1))
            ids[b].append(int(o.logits.argmax()))
        # The last pass only adds each sequence's last tap row; its logits go unused.
        outs = trunk.forward_batch([BatchItem.decode(st, seq[-1], len(p) + t)
                                    for st, seq, p in zip(states, ids, prompts)])
        for b, o in enumerate(outs):
            taps[b].append(o.taps)
    return [_sequence(ids[b], len(p), taps[b], lps[b], topk) for b, p in enumerate(prompts)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see `--help`).

    Raises:
        SystemExit: a malformed option, or --batch / --sequences / --new below 1.
    """
    ap = argparse.ArgumentParser(description="Greedy continuations + taps + top-K targets of the exported trunk.")
    ap.add_argument("--checkpoint", type=Path, default=Path("assets/dspark-small"))
    ap.add_argument("--data", type=Path, default=Path("runs/trunk/data"), help="tokenized streams (train_trunk)")
    ap.add_argument("--out", type=Path, default=Path("runs/draft/data/final"))
    ap.add_argument("--split", choices=("train", "heldout"), default="train")
    ap.add_argument("--sequences", type=int, default=200, help="sequences in this shard")
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--of", type=int, default=1)
    ap.add_argument("--prompt-min", type=int, default=8)
    ap.add_argument("--prompt-max", type=int, default=96)
    ap.add_argument("--doc-start", type=float, default=0.0,
                    help="probability that a prompt begins a document instead of a random offset")
    ap.add_argument("--mix", type=json.loads, default=None, help='domain weights, JSON (default %s)' % DEFAULT_MIX)
    ap.add_argument("--new", type=int, default=96, help="greedy tokens per sequence")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16,
                    help="sequences generated at once; the shard file is rewritten after each group")
    ap.add_argument("--numerics", choices=("fast", "exact"), default="exact",
                    help="verify numerics of the trunk (exact: the shard does not depend on --batch)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--save-every-s", type=float, default=60.0,
                    help="rewrite the shard file at most this often, in seconds (default 60)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.save_every_s < 0:
        ap.error(f"--save-every-s must be >= 0, got {args.save_every_s}")
    for name in ("batch", "sequences", "new"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def write_shard(trunk: Trunk, streams: dict[str, np.ndarray], args: argparse.Namespace) -> Path:
    """Generate (or, with --resume, complete) the shard file of `args` in groups of --batch
    sequences, rewriting it atomically after each group; returns its path."""
    starts = document_starts(streams) if args.doc_start > 0 else None
    mix = args.mix or DEFAULT_MIX
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.split}_shard{args.shard}of{args.of}.pt"
    meta = {"checkpoint": str(args.checkpoint), "split": args.split, "new": args.new, "topk": args.topk,
            "seed": args.seed, "config_hash": trunk.cfg.config_hash(), "mix": mix, "doc_start": args.doc_start,
            "prompt_min": args.prompt_min, "prompt_max": args.prompt_max, "numerics": args.numerics}
    seqs = torch.load(path, weights_only=False)["seqs"] if args.resume and path.is_file() else []
    t0, start = time.monotonic(), len(seqs)
    saved = t0
    for k0 in range(len(seqs), args.sequences, args.batch):
        group = [sample_prompt(streams, mix, args.seed, args.split, args.shard + k * args.of,
                               args.prompt_min, args.prompt_max, args.doc_start, starts)
                 for k in range(k0, min(k0 + args.batch, args.sequences))]
        made = continue_greedy_batch(trunk, [prompt for _, prompt in group], args.new, args.topk)
        for (domain, _), seq in zip(group, made):
            seq["domain"] = domain
        seqs.extend(made)
        if len(seqs) >= args.sequences or time.monotonic() - saved >= args.save_every_s:
            tmp = path.with_suffix(".tmp")
            torch.save({"meta": meta, "seqs": seqs}, tmp)
            os.replace(tmp, path)
            saved = time.monotonic()
        rate = (len(seqs) - start) / (time.monotonic() - t0)
        print(f"{path.name}: {len(seqs)}/{args.sequences} sequences, {rate:.2f} seq/s, "
              f"{rate * args.new:.0f} tok/s", flush=True)
    return path


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from training.train_trunk import load_streams

    write_shard(load_trunk(args.checkpoint, args.numerics), load_streams(args.data, args.split), args)


if __name__ == "__main__":
    main()
