"""Lab 1: build a tiny transformer from config/config.json and train it, with the whole loop in view.

    python scripts/train_tiny_transformer.py --epochs 2

Challenge: open config/config.json, change "num_hidden_layers": 2 to 4, and run the same command again.
Each run writes runs/lab1_<N>layers/metrics.jsonl, so the two runs sit side by side; compare the loss
printed at the same steps (or plot both files with course_lib.viz.plots.plot_loss_curves). Does the deeper
model's loss drop faster per step? Per second?

One epoch is enough random batches to cover the training tokens once:
ceil(tokens_per_epoch / (batch_size * block_size)) steps, with tokens_per_epoch defaulting to the whole
training split of the shipped corpus. The script prints the number of steps before it starts and the
time taken at the end (a minute or two for the default two epochs on one thread of a laptop-class CPU).

There is no Trainer here on purpose: forward -> loss -> backward -> optimizer step is written out below.
course_lib.train wraps the same steps (plus accumulation, mixed precision, checkpoints every N steps and
exact resume) for the later sessions:  python -m course_lib.train --help
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from course_lib.checkpoint.atomic import save_checkpoint
from course_lib.core.config import load_model_config
from course_lib.core.data import RandomBatches, load_tokens
from course_lib.core.metrics import MetricsLogger
from course_lib.core.model import GPT, GPTConfig
from course_lib.core.optim import configure_optimizer, get_lr
from course_lib.core.steps import evaluate


class TinyTransformer(GPT):
    """The course GPT (course_lib/core/model.py) with its shape read from a JSON config file.

    Embedding -> num_hidden_layers x [RMSNorm -> causal self-attention (RoPE) -> RMSNorm -> SwiGLU MLP]
    -> RMSNorm -> linear head tied to the embedding. A "big" model is this same code with a bigger config.
    """

    @classmethod
    def from_json(cls, path, **overrides) -> "TinyTransformer":
        return cls(load_model_config(path, **overrides))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="config/config.json", help="model config (JSON)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over tokens_per_epoch training tokens")
    parser.add_argument("--tokens_per_epoch", type=int, default=None,
                        help="training tokens one epoch covers; default: the whole training split")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (after warmup)")
    parser.add_argument("--warmup_steps", type=int, default=50, help="steps of linear LR warmup")
    parser.add_argument("--weight_decay", type=float, default=0.1, help="AdamW decay of weight matrices")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="max global gradient norm")
    parser.add_argument("--print_every", type=int, default=200, help="print the training loss every N steps")
    parser.add_argument("--eval_batches", type=int, default=20, help="validation batches per evaluation")
    parser.add_argument("--seed", type=int, default=0, help="seed of init and batch order")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads; 1 keeps the timing steady when other programs share the CPU. "
                             "Try 2 or more and compare the printed tok/s")
    parser.add_argument("--data_dir", default="data", help="token files (created on first use)")
    parser.add_argument("--out_dir", default=None, help="default: runs/lab1_<num_hidden_layers>layers")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "print_every", "eval_batches", "threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model = TinyTransformer.from_json(args.config)  # a wrong key or value in the file stops here, named
    config: GPTConfig = model.config
    out_dir = Path(args.out_dir or f"runs/lab1_{config.n_layer}layers")
    print(f"model from {args.config}: {config.n_layer} layers, hidden size {config.n_embd}, "
          f"{config.n_head} heads, {model.num_params():,} parameters")

    train_tokens = load_tokens("train", args.data_dir)
    val_tokens = load_tokens("val", args.data_dir)
    tokens_per_epoch = args.tokens_per_epoch or len(train_tokens)
    tokens_per_step = args.batch_size * config.block_size
    steps_per_epoch = math.ceil(tokens_per_epoch / tokens_per_step)
    max_steps = args.epochs * steps_per_epoch
    print(f"{len(train_tokens):,} training tokens; one epoch = {tokens_per_epoch:,} tokens = {steps_per_epoch:,} steps "
          f"of {args.batch_size} x {config.block_size} tokens; "
          f"{args.epochs} epoch{'s' if args.epochs > 1 else ''} = {max_steps:,} steps")

    optimizer = configure_optimizer(model, lr=args.lr, weight_decay=args.weight_decay)
    schedule = dict(max_lr=args.lr, min_lr=args.lr / 10, warmup_steps=min(args.warmup_steps, max_steps),
                    max_steps=max_steps)
    batches = RandomBatches(train_tokens, args.batch_size, config.block_size, seed=args.seed)

    def val_loss() -> float:
        return evaluate(model, val_tokens, batch_size=args.batch_size, block_size=config.block_size,
                        max_batches=args.eval_batches)

    print(f"step {0:6d} | val loss {val_loss():.4f} (untrained; ln(256) = {math.log(256):.4f})")
    model.train()
    start, recent_losses = time.perf_counter(), []
    with MetricsLogger(out_dir, tensorboard=False) as logger:
        for step in range(max_steps):
            lr = get_lr(step, **schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr

            idx = next(batches)                      # (batch_size, block_size) token ids
            logits, loss = model(idx, targets=idx)   # forward: position t predicts token t+1
            loss.backward()                          # backward: d(loss)/d(parameter) into .grad
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()                         # update the parameters
            optimizer.zero_grad(set_to_none=True)    # gradients would otherwise add up across steps

            recent_losses.append(loss.item())
            logger.log({"kind": "train", "step": step + 1, "loss": recent_losses[-1], "lr": lr,
                        "grad_norm": grad_norm.item()})
            if (step + 1) % args.print_every == 0:
                # One batch's loss is noisy; the mean over the last print_every steps compares runs better.
                elapsed = time.perf_counter() - start
                print(f"step {step + 1:6d} | loss {sum(recent_losses) / len(recent_losses):.4f} "
                      f"(mean of last {len(recent_losses)}) | lr {lr:.2e} | "
                      f"{tokens_per_step * (step + 1) / elapsed:,.0f} tok/s")
                recent_losses.clear()
            if (step + 1) % steps_per_epoch == 0:
                loss_val = val_loss()
                logger.log({"kind": "eval", "step": step + 1, "val_loss": loss_val})
                print(f"epoch {(step + 1) // steps_per_epoch} done at step {step + 1} | val loss {loss_val:.4f}")

    elapsed = time.perf_counter() - start
    checkpoint = save_checkpoint(out_dir / "final.pt", model=model, optimizer=optimizer, step=max_steps)
    print(f"final val loss {loss_val:.4f} after {max_steps:,} steps in {elapsed:.0f} s "
          f"({torch.get_num_threads()} threads)")
    print(f"metrics: {logger.path}; model: {checkpoint}")
    return {"final_val_loss": loss_val, "steps": max_steps, "out_dir": out_dir, "model": model}


if __name__ == "__main__":
    main()
