"""Load any checkpoint the course writes and measure held-out loss and perplexity.

    python scripts/evaluate.py runs/tiny                     # a run directory (its latest.pt)
    python scripts/evaluate.py runs/tiny/ckpt_step000200.pt  # one checkpoint file (single process or DDP)
    python scripts/evaluate.py runs/ranked/step_40           # a ranked checkpoint (manifest.json + shards)
    python scripts/evaluate.py runs/fsdp/dcp --model_size small   # a torch.distributed.checkpoint directory

Perplexity = exp(mean cross-entropy per token): the number of equally likely next tokens the model is, on
average, choosing between (256 for a byte model that knows nothing, 1 for a perfect one).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from course_lib.checkpoint.atomic import FORMAT as FILE_FORMAT
from course_lib.checkpoint.ranked import MANIFEST, load_full_parameters
from course_lib.core.config import load_model_config
from course_lib.core.data import load_tokens
from course_lib.core.model import GPT, GPTConfig
from course_lib.core.steps import evaluate

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")
EXPECTED = ("a course checkpoint file (.pt written by course_lib.checkpoint.atomic, with 'format' and 'model_config'), "
            "a run directory holding latest.pt, a ranked checkpoint directory (manifest.json + rank_*.pt), or a "
            "torch.distributed.checkpoint directory (.metadata) together with --model_size/--config")


def strip_wrapper_prefixes(state: dict) -> dict:
    """Keys saved from a wrapper (DDP's module., torch.compile's _orig_mod.) -> the plain model's keys."""
    clean = {}
    for key, value in state.items():
        for prefix in WRAPPER_PREFIXES:
            key = key.replace(prefix, "")
        clean[key] = value
    return clean


def _model_from(config_dict: dict | None, fallback: GPTConfig | None, source: Path) -> GPT:
    if config_dict:
        return GPT(GPTConfig(**config_dict))
    if fallback is not None:
        return GPT(fallback)
    raise ValueError(f"{source} does not record the model's shape: pass --model_size or --config")


def _load_dcp(directory: Path, fallback: GPTConfig | None) -> tuple[GPT, str]:
    import torch.distributed.checkpoint as dcp

    meta_file = directory / "model_config.json"
    model = _model_from(json.loads(meta_file.read_text()) if meta_file.exists() else None, fallback, directory)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(directory))  # single process: no process group needed
    model.load_state_dict(state["model"])
    return model, f"torch.distributed.checkpoint directory {directory}"


def load_model(path, fallback: GPTConfig | None = None) -> tuple[GPT, str]:
    """(model in eval mode, description of what was loaded) for any checkpoint the course writes."""
    path = Path(path)
    if path.is_dir():
        if (path / MANIFEST).exists() or any(path.glob("rank_*.pt")):
            params, manifest = load_full_parameters(path)
            model = _model_from(manifest.get("model_config"), fallback, path)
            missing = set(dict(model.named_parameters())) ^ set(params)
            if missing:
                raise ValueError(f"{path}: parameters do not match the model: {sorted(missing)}")
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(params[name])
            return model.eval(), f"ranked checkpoint of {manifest['world_size']} ranks at step {manifest['step']}"
        if (path / ".metadata").exists():
            model, what = _load_dcp(path, fallback)
            return model.eval(), what
        if (path / "latest.pt").exists():
            return load_model(path / "latest.pt", fallback)
        found = sorted(p.name for p in path.iterdir())[:8]
        raise ValueError(f"{path} is a directory holding {found or 'nothing'}; expected {EXPECTED}")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; expected {EXPECTED}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{path} ({path.stat().st_size:,} bytes) cannot be read by torch.load ({type(err).__name__}:"
                         f" {str(err).splitlines()[0] if str(err) else ''}); expected {EXPECTED}") from err
    if isinstance(ckpt, dict) and ckpt.get("format") == FILE_FORMAT:
        model = _model_from(ckpt.get("model_config"), fallback, path)
        model.load_state_dict(strip_wrapper_prefixes(ckpt["model"]))
        return model.eval(), f"checkpoint file at step {ckpt['step']}"
    if isinstance(ckpt, dict) and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        if fallback is None:
            raise ValueError(f"{path} is a bare state_dict of {len(ckpt)} tensors with no model config: pass "
                             "--model_size or --config to say which model it belongs to")
        model = GPT(fallback)
        model.load_state_dict(strip_wrapper_prefixes(ckpt))
        return model.eval(), f"bare state_dict ({len(ckpt)} tensors)"
    kind = f"a dict with keys {sorted(map(str, ckpt))[:6]}" if isinstance(ckpt, dict) else type(ckpt).__name__
    raise ValueError(f"{path} holds {kind}; expected {EXPECTED}")


@torch.no_grad()
def held_out_loss(model: GPT, tokens: torch.Tensor, batch_size: int = 32, max_batches: int | None = 50) -> dict:
    loss = evaluate(model, tokens, batch_size=batch_size, block_size=model.config.block_size, max_batches=max_batches)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": len(tokens)}


def main(argv=None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(prog="scripts/evaluate.py", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoint file or directory")
    parser.add_argument("--model_size", default=None, help="preset, for checkpoints that do not record their config")
    parser.add_argument("--config", default=None, help="JSON model config (e.g. config/config.json), same use")
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--split", default="val", choices=("train", "val"))
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--max_batches", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        fallback = load_model_config(args.config) if args.config else (
            GPTConfig.from_preset(args.model_size) if args.model_size else None)
        model, what = load_model(args.checkpoint, fallback)
        result = held_out_loss(model, load_tokens(args.split, args.data_dir), args.batch_size, args.max_batches)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    result.update(checkpoint=str(args.checkpoint), loaded=what, split=args.split, params=model.num_params())
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{what}: {model.num_params():,} parameters")
        print(f"{args.split} loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.2f}")
    return result
