"""Resumable trunk training of the bundled model on one CPU thread.

Owns the trunk's training loop (the first stage of training/rebuild.sh): batches, losses,
schedule, checkpoints and logs; it never writes the checkpoint folder (`training.export` does).

    python -m training.train_trunk --run runs/trunk --steps 900            # fresh run
    python -m training.train_trunk --run runs/trunk --resume               # continue it
    python -m training.train_trunk --run runs/trunk-v3 --init assets/dspark-small --steps 2000 --lr 5e-4 --warmup 50
    nohup .venv/bin/python -m training.train_trunk --run runs/trunk --resume >> runs/trunk/train.log 2>&1 &

Inputs: the corpus (`training.corpus`, runs/corpus) and tokenizer (`training.tokenizer`,
runs/tokenizer/tokenizer.json); the first run tokenizes the corpus once into
`<run>/data/{train,heldout}_{domain}.npy` (uint16 token streams, documents as bos .. eos).

Batches: step s draws `batch` windows of `seq_len` tokens; window b's domain (weights
`--mix`) and offset come from `numpy.random.default_rng([seed, s, b])`, so a resumed run sees
exactly the batches an uninterrupted one would. Forward: `training.forward.trunk_logits` (the
prefill path with gradients); loss = next-token cross-entropy + the indexers' auxiliary KL
(`--index-loss-weight`); AdamW with linear warm-up and cosine decay; global grad-norm clip;
after each step the scored gates' biases move by the auxiliary-loss-free rule
(`update_gate_biases`, `--bias-gamma`). Hash layers use `balanced_tid2eid` tables built from
the training split's token counts. For the last `--qat-frac` of the steps the forward runs on
the weights as the checkpoint will store them (fp8 / fp4 / bf16 round trip, straight-through
gradients to the fp32 master weights), so export costs little.

Starting point: random weights (`init_weights`), or with `--init DIR` the trunk of an
exported checkpoint folder (`training.export`'s layout), read through the verifier's loader
(`dsv4.checkpoint.load_trunk_weights`), which dequantises the fp8 / fp4 / bf16 tensors to
fp32 master weights; gate biases and `tid2eid` tables come from the folder too. The optimizer
starts fresh (zero moments), so a continued run wants a short warm-up. Such a run logs the
loaded model's held-out loss as its step-0 evaluation, before any update. `tokens` in the log
counts this run's tokens only.

Outputs in `<run>/`: `config.json` (the run's arguments), `ckpt.pt` (model, optimizer, step;
replaced atomically every `--ckpt-every-s` seconds, at each evaluation, on SIGTERM/SIGINT and
at the end), `log.jsonl` (one JSON object per step: loss, index_kl, lr, tokens, tok_s, max
expert load / mean; one per evaluation: held-out loss per domain), `final.pt` (logical fp32
trunk weights and the model config, at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from dsv4.checkpoint import load_trunk_weights
from dsv4.codecs import fp4_decode, fp4_encode, fp8_decode, fp8_encode
from dsv4.config import ModelConfig
from dsv4.init import random_weights
from dsv4.inventory import trunk_params
from dsv4.trunk import Trunk
from training.corpus import DOMAINS, read_documents
from training.forward import (EAGER, ForwardStats, MhcFns, compiled_mhc, lm_loss, trainable_parameters, trunk_logits,
                              update_gate_biases)
from training.model_config import bundled_config
from training.tokenizer import TextTokenizer

DEFAULT_MIX = {"code": 0.4, "prose": 0.25, "math": 0.15, "repeat": 0.2}


@dataclass
class TrainConfig:
    """Hyper-parameters of one run (saved as <run>/config.json; `--resume` reloads them)."""

    corpus: str = "runs/corpus"
    init: str = ""
    tokenizer: str = "runs/tokenizer/tokenizer.json"
    steps: int = 900
    batch: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.1
    clip: float = 1.0
    index_loss_weight: float = 1.0
    bias_gamma: float = 1e-3
    qat_frac: float = 0.25
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 16
    ckpt_every_s: float = 240.0
    compile_mhc: bool = True
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    model_overrides: dict[str, object] = field(default_factory=dict)

    def model_config(self) -> ModelConfig:
        """`bundled_config` with this run's `model_overrides`."""
        return bundled_config(**self.model_overrides)


# ----------------------------------------------------------------------------- data
def tokenize_corpus(corpus: Path, tokenizer: Path, out: Path, vocab_size: int) -> None:
    """Write `out/{split}_{domain}.npy` (uint16 streams of bos + text + eos per document), once.

    Raises:
        ValueError: a split/domain has no tokens, or vocab_size does not fit uint16.
    """
    if vocab_size > 2**16:
        raise ValueError(f"vocab_size={vocab_size} does not fit uint16 streams")
    if all((out / f"{s}_{d}.npy").is_file() for s in ("train", "heldout") for d in DOMAINS):
        return
    tok = TextTokenizer(tokenizer, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "heldout"):
        for domain in DOMAINS:
            texts = [d.text for d in read_documents(corpus / f"{split}.jsonl", [domain])]
            ids = [i for e in tok.encode_batch(texts) for i in (0, *e, 1)]
            if not ids:
                raise ValueError(f"{corpus}: split {split} has no {domain} documents")
            np.save(out / f"{split}_{domain}.npy", np.asarray(ids, dtype=np.uint16))


def load_streams(data: Path, split: str) -> dict[str, np.ndarray]:
    """Domain -> uint16 token stream of one split (memory-mapped)."""
    return {d: np.load(data / f"{split}_{d}.npy", mmap_mode="r") for d in DOMAINS}


def batch_windows(streams: dict[str, np.ndarray], mix: dict[str, float], step: int, batch: int,
                  seq_len: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The `batch` (domain, ids [seq_len] int64) windows of `step`, a pure function of its arguments."""
    names = [d for d in DOMAINS if mix.get(d, 0) > 0]
    p = np.array([mix[d] for d in names], dtype=np.float64)
    out = []
    for b in range(batch):
        rng = np.random.default_rng([seed, step, b])
        d = names[int(rng.choice(len(names), p=p / p.sum()))]
        s = streams[d]
        off = int(rng.integers(0, len(s) - seq_len))
        out.append((d, torch.from_numpy(np.asarray(s[off:off + seq_len], dtype=np.int64))))
    return out


def eval_windows(streams: dict[str, np.ndarray], n: int, seq_len: int) -> dict[str, list[torch.Tensor]]:
    """Per domain, `n` evenly spaced held-out windows of `seq_len` tokens (fewer if the stream is short)."""
    out = {}
    for d, s in streams.items():
        starts = np.linspace(0, len(s) - seq_len, num=min(n, max(1, len(s) // seq_len))).astype(np.int64)
        out[d] = [torch.from_numpy(np.asarray(s[o:o + seq_len], dtype=np.int64)) for o in starts]
    return out


def balanced_tid2eid(counts: np.ndarray, n_experts: int, k: int, seed: int, layer: int) -> torch.Tensor:
    """Hash routing table [V, k] int64 that balances token frequency mass over experts.

    Tokens in descending count order (ties: lower id first; unseen tokens count 1) each take
    the k least-loaded distinct experts (ties: lower expert id), adding their count to those
    experts' loads. Layer `layer` relabels experts by a permutation seeded by (seed, layer),
    so hash layers do not share a table.
    """
    V = counts.shape[0]
    c = np.maximum(counts.astype(np.int64), 1)
    load = np.zeros(n_experts, dtype=np.int64)
    table = np.zeros((V, k), dtype=np.int64)
    for t in sorted(range(V), key=lambda i: (-c[i], i)):
        chosen = np.lexsort((np.arange(n_experts), load))[:k]
        table[t] = chosen
        load[chosen] += c[t]
    perm = np.random.default_rng([seed, 7919, layer]).permutation(n_experts)
    return torch.from_numpy(perm[table])


# ----------------------------------------------------------------------------- model / optimiser
def init_weights(cfg: ModelConfig, counts: np.ndarray, seed: int) -> dict[str, torch.Tensor]:
    """`dsv4.init.random_weights` for the trunk with balanced hash tables (`balanced_tid2eid`)."""
    w = random_weights(cfg, "trunk", seed)
    for i in range(cfg.n_hash_layers):
        w[f"layers.{i}.ffn.gate.tid2eid"] = balanced_tid2eid(counts, cfg.n_routed_experts,
                                                             cfg.n_activated_experts, seed, i)
    return w


def exported_weights(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Logical trunk weights (name -> fp32 tensor; `tid2eid` int64) of an exported checkpoint
    folder, dequantised by the verifier's loader, to continue training from.

    Raises:
        ValueError: the folder's model config differs from `cfg` (both hashes and the first
            differing fields named): the weights would not fit the run's model.
        dsv4.checkpoint.CheckpointError: a missing, mis-typed or unreadable trunk tensor.
    """
    saved, weights = load_trunk_weights(folder, dtype=torch.float32)
    if saved.config_hash() != cfg.config_hash():
        a, b = saved.to_dict(), cfg.to_dict()
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise ValueError(f"--init {folder}: its model config {saved.config_hash()} is not the run's "
                         f"{cfg.config_hash()} (differing fields: {diff[:6]})")
    return weights


def make_optimizer(named: list[tuple[str, torch.nn.Parameter]], tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices except the mHC mixing weights, none on vectors."""
    decay = [p for n, p in named if p.ndim == 2 and not n.split(".")[-1].startswith("hc_")]
    rest = [p for n, p in named if not (p.ndim == 2 and not n.split(".")[-1].startswith("hc_"))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up over `warmup` steps, then cosine from lr to lr * min_lr_frac at `steps`."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def stored_roundtrip(storage: str, w: torch.Tensor) -> torch.Tensor:
    """w as the checkpoint will hold it (`dsv4.inventory.Param.storage`), dequantised to w.dtype."""
    if storage == "fp8":
        return fp8_decode(*fp8_encode(w)).to(w.dtype)
    if storage == "fp4":
        return fp4_decode(*fp4_encode(w)).to(w.dtype)
    if storage == "bf16":
        return w.to(torch.bfloat16).to(w.dtype)
    return w


@contextmanager
def stored_weights(trunk: Trunk, enabled: bool) -> Iterator[None]:
    """Straight-through fake quantisation: inside, parameters hold their stored round trip;
    on exit the fp32 master values come back (gradients computed inside apply to them)."""
    if not enabled:
        yield
        return
    storage = {p.name: p.storage for p in trunk_params(trunk.cfg)}
    masters = {}
    with torch.no_grad():
        for name, p in trunk.named_parameters():
            if storage.get(name, "f32") != "f32":
                masters[name] = p.detach().clone()
                p.copy_(stored_roundtrip(storage[name], p))
    try:
        yield
    finally:
        with torch.no_grad():
            params = dict(trunk.named_parameters())
            for name, w in masters.items():
                params[name].copy_(w)


@torch.no_grad()
def evaluate(trunk: Trunk, windows: dict[str, list[torch.Tensor]], mhc: MhcFns = EAGER) -> dict[str, float]:
    """Mean held-out next-token loss (nats) per domain, and 'all' (the mean of the domains)."""
    out = {d: float(np.mean([float(lm_loss(trunk_logits(trunk, ids, mhc=mhc), ids)) for ids in ws]))
           for d, ws in windows.items()}
    out["all"] = float(np.mean(list(out.values())))
    return out


# ----------------------------------------------------------------------------- loop
class Run:
    """One training run in a folder (see the module docstring for its files).

    `resume`: the caller restores `ckpt.pt` next, so the starting weights are placeholders
    and `tc.init` is not read again (its folder may have changed or gone since).
    """

    def __init__(self, folder: Path, tc: TrainConfig, resume: bool = False):
        self.folder, self.tc = folder, tc
        self.cfg = tc.model_config()
        data = folder / "data"
        tokenize_corpus(Path(tc.corpus), Path(tc.tokenizer), data, self.cfg.vocab_size)
        self.train = load_streams(data, "train")
        self.heldout = eval_windows(load_streams(data, "heldout"), tc.eval_windows, tc.seq_len)
        counts = sum(np.bincount(s, minlength=self.cfg.vocab_size) for s in self.train.values())
        torch.manual_seed(tc.seed)
        self.trunk = Trunk(self.cfg)
        self.trunk.load_weights(exported_weights(Path(tc.init), self.cfg) if tc.init and not resume
                                else init_weights(self.cfg, counts, tc.seed))
        self.named = trainable_parameters(self.trunk)
        self.opt = make_optimizer(self.named, tc)
        self.step = 0
        self.stop = False
        self.mhc = self.checked_compile() if tc.compile_mhc else EAGER

    @torch.no_grad()
    def checked_compile(self, tol: float = 1e-4) -> MhcFns:
        """`compiled_mhc()` if its logits match eager ones on a held-out window (rel max error
        < tol), else EAGER (compile failures included); the outcome is logged."""
        ids = next(iter(self.heldout.values()))[0]
        ref = trunk_logits(self.trunk, ids)
        try:
            mhc = compiled_mhc()
            err = float((trunk_logits(self.trunk, ids, mhc=mhc) - ref).abs().max() / ref.abs().max())
        except Exception as e:  # noqa: BLE001 - any compiler problem means: train eagerly
            self.log({"compile_mhc": "failed", "error": repr(e)[:500]})
            return EAGER
        self.log({"compile_mhc": "ok" if err < tol else "mismatch", "rel_err_vs_eager": err})
        return mhc if err < tol else EAGER

    def save(self, path: Path, extra: dict | None = None) -> None:
        """Write step, model and optimizer state and both configs to `path` atomically (tmp + rename)."""
        tmp = path.with_suffix(".tmp")
        torch.save({"step": self.step, "model": self.trunk.state_dict(), "optimizer": self.opt.state_dict(),
                    "train_config": asdict(self.tc), "model_config": self.cfg.to_dict(), **(extra or {})}, tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        """Restore model, optimizer and step from a `save` file (gate biases and tid2eid are model state)."""
        ck = torch.load(path, map_location="cpu", weights_only=False)
        self.trunk.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optimizer"])
        self.step = ck["step"]

    def log(self, record: dict) -> None:
        """Append one JSON record to <run>/log.jsonl."""
        with (self.folder / "log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def train_step(self) -> dict:
        """One optimizer step over `batch` windows (per-window backward); returns its log record."""
        tc, step = self.tc, self.step
        lr = lr_at(step, tc)
        for group in self.opt.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        loss_sum = kl_sum = 0.0
        loads: dict[int, torch.Tensor] = {}
        with stored_weights(self.trunk, step >= tc.steps * (1 - tc.qat_frac)):
            for _, ids in batch_windows(self.train, tc.mix, step, tc.batch, tc.seq_len, tc.seed):
                stats = ForwardStats()
                loss = lm_loss(trunk_logits(self.trunk, ids, stats, self.mhc), ids)
                kl = torch.stack(stats.index_kl).mean() if stats.index_kl else loss.new_zeros(())
                ((loss + tc.index_loss_weight * kl) / tc.batch).backward()
                loss_sum, kl_sum = loss_sum + float(loss.detach()), kl_sum + float(kl.detach())
                for layer, load in stats.expert_load.items():
                    loads[layer] = loads.get(layer, 0) + load
        gnorm = float(torch.nn.utils.clip_grad_norm_([p for _, p in self.named], tc.clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        update_gate_biases(self.trunk, loads, tc.bias_gamma)
        self.step += 1
        dt = time.perf_counter() - t0
        imbalance = {str(k): round(float(v.max() / v.float().mean()), 3) for k, v in loads.items()}
        return dict(step=self.step, loss=loss_sum / tc.batch, index_kl=kl_sum / tc.batch, lr=lr, grad_norm=gnorm,
                    tokens=self.step * tc.batch * tc.seq_len, step_s=round(dt, 3),
                    tok_s=round(tc.batch * tc.seq_len / dt, 1), max_load_over_mean=imbalance)

    def run(self) -> None:
        """Train to `steps` (or until SIGTERM/SIGINT), evaluating and checkpointing on the way;
        at the end also evaluate the stored-weight round trip and write final.pt."""
        tc = self.tc
        ckpt = self.folder / "ckpt.pt"
        last_save = time.monotonic()
        started = time.monotonic()
        first_step = self.step
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stop", True))
        if tc.init and self.step == 0:  # the starting model's loss: the 'before' of a continued run
            ev = evaluate(self.trunk, self.heldout, self.mhc)
            self.log({"step": 0, "tokens": 0, "init": tc.init, "heldout": ev})
            print(json.dumps({"step": 0, "init": tc.init, "heldout": ev}), flush=True)
        while self.step < tc.steps and not self.stop:
            rec = self.train_step()
            done = self.step - first_step
            rec["eta_s"] = round((time.monotonic() - started) / done * (tc.steps - self.step))
            self.log(rec)
            print(json.dumps(rec), flush=True)
            if self.step % tc.eval_every == 0 or self.step == tc.steps:
                ev = evaluate(self.trunk, self.heldout, self.mhc)
                self.log({"step": self.step, "tokens": rec["tokens"], "heldout": ev})
                print(json.dumps({"step": self.step, "heldout": ev}), flush=True)
                self.save(ckpt)
                last_save = time.monotonic()
            elif time.monotonic() - last_save > tc.ckpt_every_s:
                self.save(ckpt)
                last_save = time.monotonic()
        self.save(ckpt)
        if self.step >= tc.steps:
            with stored_weights(self.trunk, tc.qat_frac > 0):
                ev = evaluate(self.trunk, self.heldout, self.mhc)
            self.log({"step": self.step, "heldout_stored_weights": ev})
            torch.save({"model_config": self.cfg.to_dict(),
                        "weights": {k: v.detach().clone() for k, v in self.trunk.state_dict().items()}},
                       self.folder / "final.pt")
            print(json.dumps({"done": self.step, "heldout_stored_weights": ev}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="Train the bundled model's trunk (resumable; see the module docstring).")
    ap.add_argument("--run", type=Path, default=Path("runs/trunk"), help="run folder (checkpoints, logs)")
    ap.add_argument("--resume", action="store_true", help="continue <run>/ckpt.pt with the saved config")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: leave the machine usable)")
    for f in TrainConfig.__dataclass_fields__.values():
        if f.type in ("int", "float", "str"):
            ap.add_argument("--" + f.name.replace("_", "-"), type={"int": int, "float": float, "str": str}[f.type],
                            default=None)
    ap.add_argument("--mix", type=json.loads, default=None, help='domain weights, JSON, e.g. {"code": 0.5, ...}')
    ap.add_argument("--model-overrides", type=json.loads, default=None, help="JSON overrides of bundled_config")
    ap.add_argument("--no-compile-mhc", dest="compile_mhc", action="store_const", const=False, default=None,
                    help="run the mHC functions eagerly (default: torch.compile them, checked against eager)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    saved = args.run / "config.json"
    if args.resume:
        tc = TrainConfig(**json.loads(saved.read_text()))
        changed = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None}
        if "steps" in changed:  # the only setting a resume may change (extend or shorten a run)
            tc.steps = changed["steps"]
    else:
        if (args.run / "ckpt.pt").exists():
            raise SystemExit(f"{args.run}/ckpt.pt exists: pass --resume, or choose another --run folder")
        kw = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None}
        tc = TrainConfig(**kw)
        if tc.init:  # recorded absolute, so config.json names the folder whatever the working directory
            tc.init = str(Path(tc.init).resolve())
    args.run.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(asdict(tc), indent=2) + "\n")
    run = Run(args.run, tc, resume=args.resume)
    if args.resume:
        run.load(args.run / "ckpt.pt")
        print(f"resumed at step {run.step} of {tc.steps}", flush=True)
    run.run()


if __name__ == "__main__":
    main()
