"""Resumable training of the bundled DSpark draft against the frozen, exported trunk.

Owns the draft's training loop (the second stage of training/rebuild.sh, after the trunk):
losses, schedule, checkpoints and metrics; only `mtp.*` trains, and the trunk, its embedding
and head are never changed.

    python -m training.train_draft --run runs/draft/final --data 'runs/draft/data/final/train_*.pt' \
        --heldout 'runs/draft/data/final/heldout_*.pt' --checkpoint assets/dspark-small --steps 1500
    python -m training.train_draft --run runs/draft/final --resume          # continue it
    nohup .venv/bin/python -m training.train_draft ... >> runs/draft/final/train.log 2>&1 &

Data: `training.draft_data` shards (the exported trunk's greedy continuations, tap rows and
top-K log-probabilities). Model: `DSparkDraft` of the checkpoint's config; embed and head
come from the checkpoint (the trunk's, frozen and shared); only `mtp.*` trains (gate
biases excepted), initialised randomly (`dsv4.init.random_weights`) or from `--init` (a
previous run's final.pt or an exported checkpoint folder, e.g. a draft trained against an
earlier trunk). A run with held-out data evaluates once before its first step.

Step: `--seqs` sequences; per sequence every seed p whose whole block lies in the greedy
continuation (P-2 <= p <= S-2-B: slot j predicts ids[p+2+j], a trunk greedy token, from the
trunk's distribution at p+1+j) through `training.draft_forward.draft_blocks` (teacher-forced
Markov head). Losses (DSpark paper as a guide), slot j weighted by `--slot-decay`^j:
* cross-entropy of the slot's logits to the trunk's greedy token;
* total variation ½‖p_draft − p_target‖₁ (`--tv-weight`), p_target from the stored top-K
  (the mass outside the top-K is one bucket on both sides, so this is a lower bound);
* the confidence head: BCE of its logit toward 1 − TV (TV detached), weight `--conf-weight`;
  `--conf-target match` uses the slot's greedy match instead (what a greedy verify decides),
  and `--only PREFIX` trains only the parameters under PREFIX (e.g. a confidence-head pass).
AdamW, linear warm-up then cosine decay to `--min-lr-frac`, global grad-norm clip. With
`--minutes M` the run also ends after M minutes of training time (the wall time of its steps
and evaluations, kept across resumes; a run paused with SIGSTOP does not spend it) and the
cosine follows whichever of steps and time is further along. A resume may change `--steps`
and `--minutes`.

While a `training.draft_data` generator still writes the shards, every `--reload-every` steps
the run re-reads them if they changed (more sequences; the batch draw depends on the count).

Metrics (train and held-out): the per-slot greedy match rate under teacher forcing,
h(j) = P(slot j = target | slots < j matched) (the acceptance of a greedy verify), and the
mean acceptance length E[accepted] = sum_j prod_{i<=j} h(i) (a bonus token not counted).

Outputs in `<run>/`: config.json, ckpt.pt (every `--ckpt-every-s`, at each evaluation, on
SIGTERM/SIGINT, at the end), log.jsonl (one JSON line per step and per evaluation),
final.pt ({"mtp": logical mtp.* weights, "config": model config}) at the end, which
`training.export --draft` writes into the checkpoint folder. A run stopped by SIGTERM/SIGINT
writes no final.pt and exits 1, so a pipeline (training/rebuild.sh) neither takes the
half-trained draft as done nor carries on; `--resume` continues it.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dsv4.checkpoint import load_drafter_weights
from dsv4.dspark import DSparkDraft
from dsv4.init import random_weights
from dsv4.inventory import drafter_params
from training.draft_forward import draft_blocks, trainable_parameters


@dataclass
class DraftTrainConfig:
    checkpoint: str = "assets/dspark-small"
    data: str = "runs/draft/data/final/train_*.pt"
    heldout: str = ""
    init: str = ""
    steps: int = 1000
    seqs: int = 1
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    tv_weight: float = 1.0
    conf_weight: float = 0.2
    slot_decay: float = 0.85
    seed: int = 0
    eval_every: int = 100
    ckpt_every_s: float = 120.0
    reload_every: int = 50
    minutes: float = 0.0
    conf_target: str = "tv"
    only: str = ""


def init_weights(source: str) -> dict[str, torch.Tensor]:
    """The `mtp.*` weights (fp32, logical names) to start from: a run's final.pt, or an exported
    checkpoint folder read through the drafter's loader (a draft trained against an earlier
    trunk, e.g. the committed one). Raises FileNotFoundError naming `source` if it is neither."""
    path = Path(source)
    if path.is_dir():
        _, weights, _ = load_drafter_weights(str(path))
        return {n: t.float() for n, t in weights.items() if n.startswith("mtp.")}
    if not path.is_file():
        raise FileNotFoundError(f"--init {source!r}: neither a final.pt nor a checkpoint folder")
    return torch.load(path, map_location="cpu", weights_only=False)["mtp"]


def load_sequences(pattern: str) -> list[dict]:
    """Every sequence of the draft_data shards matching `pattern` (sorted by file name)."""
    out = []
    for f in sorted(glob.glob(pattern)):
        out.extend(torch.load(f, weights_only=False)["seqs"])
    return out


def data_stamp(pattern: str) -> tuple:
    """(name, mtime, size) of every shard matching `pattern`: changes when a generator adds sequences."""
    return tuple((f, os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in sorted(glob.glob(pattern)))


def seeds_of(seq: dict, B: int) -> torch.Tensor:
    """Seed positions whose whole block lies in the greedy continuation: P-2..S-2-B."""
    P, S = seq["prompt_len"], seq["ids"].shape[0]
    return torch.arange(max(P - 2, 0), S - B - 1)


def block_targets(seq: dict, seeds: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(greedy tokens [N, B], top-K ids [N, B, K], top-K log-probs [N, B, K]) of each slot."""
    P = seq["prompt_len"]
    j = torch.arange(B)
    tokens = seq["ids"][seeds[:, None] + 2 + j]
    rows = seeds[:, None] + 2 + j - P  # row r of top_* = the distribution of position P + r
    return tokens, seq["top_ix"][rows].long(), seq["top_lp"][rows]


def losses(logits: torch.Tensor, conf: torch.Tensor | None, tokens: torch.Tensor, top_ix: torch.Tensor,
           top_lp: torch.Tensor, weights: torch.Tensor, conf_target: str = "tv") -> dict[str, torch.Tensor]:
    """CE, TV and confidence BCE (slot-weighted means) and the match indicator [N, B]."""
    logp = torch.log_softmax(logits.float(), -1)  # [N, B, V]
    ce = -logp.gather(-1, tokens.unsqueeze(-1))[..., 0]  # [N, B]
    pd, pt = logp.gather(-1, top_ix).exp(), top_lp.exp()  # [N, B, K]
    tv = 0.5 * ((pd - pt).abs().sum(-1) + ((1 - pd.sum(-1)) - (1 - pt.sum(-1))).abs())  # [N, B]
    w = weights / weights.sum()
    out = {"ce": (ce * w).sum(-1).mean(), "tv": (tv * w).sum(-1).mean(),
           "match": (logits.argmax(-1) == tokens).float()}
    if conf is not None:
        if conf_target == "match":  # the greedy verify's outcome of the slot (teacher-forced prefix)
            target = (logits.argmax(-1) == tokens).float()
        else:
            target = (1 - tv.detach()).clamp(0, 1)
        out["conf"] = (F.binary_cross_entropy_with_logits(conf, target, reduction="none") * w).sum(-1).mean()
    return out


def acceptance(match: torch.Tensor) -> dict[str, object]:
    """match [N, B] (teacher-forced greedy matches) -> h(j), mean acceptance length, accept rate."""
    run = match.cumprod(-1)  # [N, B]: slots 0..j all matched
    prior = torch.cat((torch.ones_like(run[:, :1]), run[:, :-1]), -1)
    h = [float(run[:, j].sum() / prior[:, j].sum().clamp(min=1)) for j in range(match.shape[1])]
    length = float(run.sum(-1).mean())
    return {"h": [round(x, 4) for x in h], "accept_len": round(length, 4),
            "accept_rate": round(length / match.shape[1], 4)}


class Run:
    """One draft training run in a folder (see the module docstring)."""

    def __init__(self, folder: Path, tc: DraftTrainConfig):
        self.folder, self.tc = folder, tc
        cfg, weights, _ = load_drafter_weights(tc.checkpoint)
        self.cfg = cfg
        if tc.init:
            weights = {**weights, **init_weights(tc.init)}
        else:
            rnd = random_weights(cfg, "all", seed=tc.seed)
            weights = {**weights, **{n: rnd[n] for n in weights if n.startswith("mtp.")}}
        self.module = DSparkDraft(cfg)
        self.module.load_weights({p.name: weights[p.name] for p in drafter_params(cfg)})
        self.named = trainable_parameters(self.module)
        if tc.only:  # train only the parameters under this prefix (e.g. the confidence head)
            for n, p in self.named:
                p.requires_grad_(n.startswith(tc.only))
            self.named = [(n, p) for n, p in self.named if n.startswith(tc.only)]
        decay = [p for n, p in self.named if p.ndim >= 2]
        rest = [p for n, p in self.named if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
        self.train = load_sequences(tc.data)
        self.data_stamp = data_stamp(tc.data)
        self.heldout = load_sequences(tc.heldout) if tc.heldout else []
        B = cfg.dspark_block_size
        self.weights = tc.slot_decay ** torch.arange(B, dtype=torch.float32)
        self.step, self.stop = 0, False
        self.trained_s = 0.0  # seconds spent in steps and evaluations, this run's and the resumed ones

    def progress(self) -> float:
        """Fraction of the run done: by steps, or by wall time when `minutes` is set (whichever is further)."""
        tc = self.tc
        t = (self.step - tc.warmup) / max(1, tc.steps - tc.warmup)
        if tc.minutes > 0:
            t = max(t, self.elapsed() / (tc.minutes * 60))
        return min(1.0, t)

    def elapsed(self) -> float:
        """Training time so far (s): the wall time of steps and evaluations only, so a run
        paused with SIGSTOP (to free the cores for a benchmark) keeps its time budget."""
        return self.trained_s

    def lr_at(self, step: int) -> float:
        tc = self.tc
        if step < tc.warmup:
            return tc.lr * (step + 1) / tc.warmup
        t = self.progress()
        return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))

    def mtp_weights(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.module.state_dict().items() if n.startswith("mtp.")}

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"step": self.step, "elapsed_s": self.elapsed(), "mtp": self.mtp_weights(),
                    "optimizer": self.opt.state_dict(),
                    "train_config": asdict(self.tc), "model_config": self.cfg.to_dict()}, tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        with torch.no_grad():
            own = self.module.state_dict(keep_vars=True)
            for n, t in ck["mtp"].items():
                own[n].copy_(t)
        self.opt.load_state_dict(ck["optimizer"])
        self.step = ck["step"]
        self.trained_s = ck.get("elapsed_s", 0.0)

    def log(self, record: dict) -> None:
        with open(self.folder / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def forward(self, seq: dict) -> dict[str, torch.Tensor]:
        B = self.cfg.dspark_block_size
        seeds = seeds_of(seq, B)
        tokens, top_ix, top_lp = block_targets(seq, seeds, B)
        out = draft_blocks(self.module, seq["taps"], seq["ids"], seeds, prev="teacher")
        return losses(out.logits, out.confidence, tokens, top_ix, top_lp, self.weights, self.tc.conf_target)

    def train_step(self) -> dict:
        tc = self.tc
        t0 = time.monotonic()
        rng = np.random.default_rng([tc.seed, self.step])
        picks = rng.choice(len(self.train), size=tc.seqs, replace=False)
        lr = self.lr_at(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        parts, matches = [], []
        for i in picks:
            ls = self.forward(self.train[int(i)])
            loss = ls["ce"] + tc.tv_weight * ls["tv"] + tc.conf_weight * ls.get("conf", 0.0)
            (loss / tc.seqs).backward()
            parts.append({k: float(v) for k, v in ls.items() if k != "match"})
            matches.append(ls["match"])
        gn = torch.nn.utils.clip_grad_norm_([p for _, p in self.named], tc.clip)
        self.opt.step()
        self.step += 1
        step_s = time.monotonic() - t0
        self.trained_s += step_s
        rec = {"step": self.step, "elapsed_s": round(self.elapsed(), 1), "lr": lr, "grad_norm": float(gn),
               "step_s": round(step_s, 3)}
        rec.update({k: round(float(np.mean([p[k] for p in parts])), 5) for k in parts[0]})
        rec.update(acceptance(torch.cat(matches)))
        return rec

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out CE / TV / conf and acceptance per domain and over all sequences."""
        t0 = time.monotonic()
        try:
            return self._evaluate()
        finally:
            self.trained_s += time.monotonic() - t0

    def _evaluate(self) -> dict:
        by: dict[str, list] = {}
        for seq in self.heldout:
            ls = self.forward(seq)
            by.setdefault(seq["domain"], []).append(ls)
            by.setdefault("all", []).append(ls)
        out = {}
        for d, items in by.items():
            rec = {k: round(float(np.mean([float(x[k]) for x in items])), 5) for k in items[0] if k != "match"}
            rec.update(acceptance(torch.cat([x["match"] for x in items])))
            out[d] = rec
        return out

    def run(self) -> None:
        tc, ckpt = self.tc, self.folder / "ckpt.pt"

        def request_stop(signum, frame):
            self.stop = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)
        last_save = time.monotonic()
        if self.heldout and self.step == 0:  # the starting point: random or --init weights
            ev = self.evaluate()
            self.log({"step": 0, "heldout": ev})
            print(json.dumps({"step": 0, "heldout": ev}), flush=True)
        while self.step < tc.steps and not self.stop and not (tc.minutes > 0 and self.elapsed() > tc.minutes * 60):
            rec = self.train_step()
            self.log(rec)
            print(json.dumps(rec), flush=True)
            if tc.reload_every and self.step % tc.reload_every == 0 and data_stamp(tc.data) != self.data_stamp:
                self.data_stamp, self.train = data_stamp(tc.data), load_sequences(tc.data)
                self.log({"step": self.step, "reloaded_sequences": len(self.train)})
            if self.heldout and (self.step % tc.eval_every == 0 or self.step == tc.steps):
                ev = self.evaluate()
                self.log({"step": self.step, "heldout": ev})
                print(json.dumps({"step": self.step, "heldout": ev}), flush=True)
                self.save(ckpt)
                last_save = time.monotonic()
            elif time.monotonic() - last_save > tc.ckpt_every_s:
                self.save(ckpt)
                last_save = time.monotonic()
        if self.heldout and self.step % tc.eval_every:
            ev = self.evaluate()
            self.log({"step": self.step, "heldout": ev})
            print(json.dumps({"step": self.step, "heldout": ev}), flush=True)
        self.save(ckpt)
        if self.stop:
            raise SystemExit(f"stopped by a signal at step {self.step}: {ckpt} saved, no final.pt; --resume continues")
        torch.save({"mtp": self.mtp_weights(), "config": self.cfg.to_dict(), "step": self.step},
                   self.folder / "final.pt")
        print(json.dumps({"done": self.step}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="Train the bundled DSpark draft (resumable; see the module docstring).")
    ap.add_argument("--run", type=Path, default=Path("runs/draft/final"))
    ap.add_argument("--resume", action="store_true", help="continue <run>/ckpt.pt with the saved config")
    ap.add_argument("--threads", type=int, default=1)
    for name, value in asdict(DraftTrainConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.run.mkdir(parents=True, exist_ok=True)
    given = {k: v for k, v in vars(args).items() if k in DraftTrainConfig.__dataclass_fields__ and v is not None}
    if args.resume:
        saved = json.loads((args.run / "config.json").read_text())
        # steps and minutes may change on a resume (extend or shorten a run; the cosine then
        # follows the new length, a warm restart when it grows)
        tc = DraftTrainConfig(**{**saved, **{k: v for k, v in given.items() if k in ("steps", "minutes")}})
    else:
        if (args.run / "ckpt.pt").exists():
            raise SystemExit(f"{args.run}/ckpt.pt exists: pass --resume, or choose another --run folder")
        tc = DraftTrainConfig(**given)
    (args.run / "config.json").write_text(json.dumps(asdict(tc), indent=2) + "\n")
    run = Run(args.run, tc)
    if args.resume:
        run.load(args.run / "ckpt.pt")
        print(f"resumed at step {run.step} of {tc.steps}", flush=True)
    run.run()


if __name__ == "__main__":
    main()
