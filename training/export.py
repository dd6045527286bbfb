"""Export the bundled model (trunk + DSpark draft) in the real checkpoint layout.

Owns turning training weights into a checkpoint folder; it writes only through
`dsv4.checkpoint.save_checkpoint` (never its own tensor format), so the services load the
result exactly as they load the real checkpoint.

    python -m training.export --trunk runs/trunk/final.pt --draft runs/draft/final.pt --out assets/dspark-small

Writes, through `dsv4.checkpoint.save_checkpoint`: fp8 linears as F8_E4M3 + ue8m0 block
scales, routed experts as fp4 packed I8 + e8m0 scales, norms / mHC / heads as bf16 or f32
as `dsv4.inventory` says, sharded `model-0000k-of-0000N.safetensors` + index + config.json,
plus the tokenizer (`tokenizer.json`, the DSpark noise id reserved outside it).

Inputs: `--trunk` is a `training.train_trunk` file: `final.pt` ({"weights": ...}) or a
`ckpt.pt` ({"model": ...}, for dry runs while the trunk trains). `--draft` is a
`training.train_draft` file ({"mtp": logical mtp.* weights}); without it the `mtp.*`
tensors are random (`dsv4.init.random_weights`, a placeholder that keeps the folder loadable).

Reports the held-out next-token loss (nats, mean of the domains' evenly spaced windows)
of the fp32 training weights and of the trunk read back through `load_trunk_weights`
(the verifier's loader), and the folder's size; refuses to finish above `--max-mb`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from dsv4.checkpoint import load_trunk_weights, save_checkpoint
from dsv4.config import ModelConfig
from dsv4.init import random_weights
from dsv4.inventory import drafter_params, trunk_params
from dsv4.trunk import Trunk
from training.forward import lm_loss, trunk_logits

SHARD_BYTES = 8 * 2**20  # several shards even for the small model, as the real checkpoint has


def read_trunk(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, logical fp32 trunk weights) of a train_trunk `final.pt` or `ckpt.pt`."""
    ck = torch.load(path, map_location="cpu", weights_only=False)
    cfg = ModelConfig.from_dict(ck["model_config"])
    state = ck["weights"] if "weights" in ck else ck["model"]
    names = [p.name for p in trunk_params(cfg)]
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"{path}: trunk weights missing {missing[:4]} ({len(missing)} in all)")
    return cfg, {n: state[n].detach().float() if state[n].is_floating_point() else state[n] for n in names}


def read_draft(path: str | Path | None, cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Logical `mtp.*` weights from a train_draft file, or random ones when `path` is None."""
    names = [p.name for p in drafter_params(cfg) if p.name.startswith("mtp.")]
    if path is None:
        w = random_weights(cfg, "all", seed=seed)
        return {n: w[n] for n in names}
    state = torch.load(path, map_location="cpu", weights_only=False)["mtp"]
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"{path}: draft weights missing {missing[:4]} ({len(missing)} in all)")
    return {n: state[n].detach().float() for n in names}


def heldout_windows(data: Path, n: int, seq_len: int) -> dict[str, list[torch.Tensor]]:
    """Per domain, `n` evenly spaced held-out windows (train_trunk's `eval_windows`)."""
    from training.train_trunk import eval_windows, load_streams
    return eval_windows(load_streams(data, "heldout"), n, seq_len)


@torch.no_grad()
def heldout_loss(cfg: ModelConfig, weights: dict[str, torch.Tensor], windows: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Mean held-out loss per domain and 'all' (mean of domains) of a trunk with `weights` (fp32)."""
    trunk = Trunk(cfg)
    trunk.load_weights(weights)
    out = {d: float(np.mean([float(lm_loss(trunk_logits(trunk, ids), ids)) for ids in ws])) for d, ws in windows.items()}
    out["all"] = float(np.mean(list(out.values())))
    return out


def tokenizer_config(max_seq_len: int) -> dict:
    """The folder's tokenizer_config.json: what `transformers.AutoTokenizer` needs to load
    tokenizer.json as a `PreTrainedTokenizerFast` (its special tokens; none added to a
    prompt, as the gateway adds none) and the chat template the HTTP front renders
    (`services.http.chat.PLAIN_TEMPLATE`)."""
    from services.http.chat import PLAIN_TEMPLATE
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": max_seq_len, "chat_template": PLAIN_TEMPLATE}


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def export(trunk_path: Path, draft_path: Path | None, out: Path, tokenizer: Path, data: Path | None,
           windows: int, seq_len: int, max_mb: float) -> dict:
    """Write the checkpoint folder `out` and return the report (losses, sizes, seconds)."""
    t0 = time.monotonic()
    cfg, trunk_w = read_trunk(trunk_path)
    draft_w = read_draft(draft_path, cfg)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_checkpoint(tmp, cfg, {**trunk_w, **draft_w}, max_shard_bytes=SHARD_BYTES)
    shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg.max_seq_len), indent=2) + "\n")
    size = folder_bytes(tmp)
    if size > max_mb * 2**20:
        raise SystemExit(f"{tmp}: {size / 2**20:.1f} MiB exceeds --max-mb {max_mb}")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    report = {"trunk": str(trunk_path), "draft": str(draft_path) if draft_path else None, "out": str(out),
              "bytes": size, "export_s": round(time.monotonic() - t0, 1)}
    if data is not None and windows > 0:
        wins = heldout_windows(data, windows, seq_len)
        report["heldout_fp32"] = heldout_loss(cfg, trunk_w, wins)
        _, loaded = load_trunk_weights(out)
        report["heldout_exported"] = heldout_loss(cfg, loaded, wins)
    report["total_s"] = round(time.monotonic() - t0, 1)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description="Export the bundled model in the real checkpoint layout.")
    ap.add_argument("--trunk", type=Path, default=Path("runs/trunk/final.pt"))
    ap.add_argument("--draft", type=Path, default=None, help="train_draft file (default: random mtp.* weights)")
    ap.add_argument("--out", type=Path, default=Path("assets/dspark-small"))
    ap.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer/tokenizer.json"))
    ap.add_argument("--data", type=Path, default=Path("runs/trunk/data"), help="tokenized held-out streams")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per domain (0: skip the losses)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-mb", type=float, default=40.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report = export(args.trunk, args.draft, args.out, args.tokenizer, args.data, args.windows, args.seq_len, args.max_mb)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
