"""What the capstone harness learns from inside each rank of a learner's script, without changing the script.

    torchrun --nproc_per_node=2 -m course_tools.capstone.probe my_train.py --max_steps 8 ...

The probe is the program torchrun starts; it installs a few observers, then runs the script as `__main__` with
the script's own arguments (runpy, the way `python my_train.py` would). When the script ends, by returning,
sys.exit or an exception, the probe writes what it saw to $CAPSTONE_REPORT_DIR/rank_<r>.json. A rank killed by
a signal writes nothing, which is how the harness knows it did not exit cleanly. The observers:

- optimizer steps: torch's global optimizer step hook counts the steps of the first optimizer that steps;
- losses: every backward() of a scalar is recorded, and a step's loss is the mean of those since the last
  step (gradient accumulation averages its micro-batches); the harness averages the ranks' losses;
- checkpoints: torch.save records which rank wrote which file (writes inside torch.distributed.checkpoint's
  save, where every rank writes its own shard, are counted as one sharded save);
- DistributedSampler: each iteration's epoch, to find a shuffling sampler that repeats an epoch;
- the stop: with CAPSTONE_STOP_AT_STEP=k, rank 0 sends SIGTERM to torchrun after its k-th step, and torchrun
  passes it to every rank, as a cluster does at a time limit or a preemption. The probe also notes whether the
  script had a SIGTERM handler when the signal went out.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

REPORT_DIR = "CAPSTONE_REPORT_DIR"
STOP_AT_STEP = "CAPSTONE_STOP_AT_STEP"


class Probe:
    def __init__(self, rank: int, stop_at: int | None):
        self.rank, self.stop_at = rank, stop_at
        self.steps, self.losses, self.pending = 0, [], []
        self.saves, self.sharded_saves, self.sampler_epochs = [], 0, {}
        self.optimizer_id = None
        self.signal_sent_after_step, self.handler_at_signal = None, None
        self.local = threading.local()
        self.started = time.time()

    # -- observers ----------------------------------------------------------------------------------------------
    def install(self) -> None:
        import torch
        import torch.autograd
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.utils.data import distributed as data_distributed

        probe = self
        backward = torch.autograd.backward

        def recording_backward(tensors, *args, **kwargs):
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                probe.pending.append(float(tensors.detach().float().item()))
            return backward(tensors, *args, **kwargs)

        torch.autograd.backward = recording_backward
        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: probe.on_step(optimizer))

        save = torch.save

        def recording_save(obj, f, *args, **kwargs):
            if not getattr(probe.local, "sharded", 0):
                name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)  # a path, or an open file's
                probe.saves.append({"path": os.path.abspath(os.fspath(name)) if isinstance(name, (str, os.PathLike))
                                    else repr(f), "after_step": probe.steps})
            return save(obj, f, *args, **kwargs)

        torch.save = recording_save
        try:
            import torch.distributed.checkpoint as dcp
        except ImportError:
            dcp = None
        if dcp is not None:
            for name in ("save", "async_save", "save_state_dict"):
                if hasattr(dcp, name):
                    setattr(dcp, name, self._sharded(getattr(dcp, name)))

        sampler_iter = data_distributed.DistributedSampler.__iter__

        def recording_iter(sampler):
            epochs = probe.sampler_epochs.setdefault(str(id(sampler)), {"shuffle": bool(sampler.shuffle), "epochs": []})
            epochs["epochs"].append(int(sampler.epoch))
            return sampler_iter(sampler)

        data_distributed.DistributedSampler.__iter__ = recording_iter

    def _sharded(self, fn):
        probe = self

        def sharded_save(*args, **kwargs):
            probe.local.sharded = getattr(probe.local, "sharded", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                probe.local.sharded -= 1
                if probe.local.sharded == 0:
                    probe.sharded_saves += 1
                    probe.saves.append({"path": "<torch.distributed.checkpoint>", "after_step": probe.steps,
                                        "sharded": True})

        return sharded_save

    def on_step(self, optimizer) -> None:
        if self.optimizer_id is None:
            self.optimizer_id = id(optimizer)
        if id(optimizer) != self.optimizer_id:
            return
        self.steps += 1
        self.losses.append(sum(self.pending) / len(self.pending) if self.pending else None)
        self.pending = []
        if self.rank == 0 and self.stop_at is not None and self.steps == self.stop_at:
            handler = signal.getsignal(signal.SIGTERM)
            self.handler_at_signal = "default" if handler in (signal.SIG_DFL, None) else (
                "ignored" if handler == signal.SIG_IGN else "installed")
            self.signal_sent_after_step = self.steps
            if os.environ.get(REPORT_DIR):  # written now: a rank the signal kills writes no report
                (Path(os.environ[REPORT_DIR]) / "signal.json").write_text(json.dumps(
                    {"after_step": self.steps, "handler": self.handler_at_signal}) + "\n")
            os.kill(os.getppid(), signal.SIGTERM)  # torchrun's agent: it forwards SIGTERM to every worker

    # -- the report ---------------------------------------------------------------------------------------------
    def write(self, exit_code, error: str | None) -> None:
        folder = os.environ.get(REPORT_DIR)
        if not folder:
            return
        report = {"rank": self.rank, "world_size": int(os.environ.get("WORLD_SIZE", 1)), "steps": self.steps,
                  "losses": self.losses, "saves": self.saves, "samplers": list(self.sampler_epochs.values()),
                  "exit_code": exit_code, "error": error, "seconds": round(time.time() - self.started, 3),
                  "signal_sent_after_step": self.signal_sent_after_step, "handler_at_signal": self.handler_at_signal}
        path = Path(folder) / f"rank_{self.rank}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(report) + "\n")
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: torchrun ... -m course_tools.capstone.probe SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    stop = os.environ.get(STOP_AT_STEP)
    probe = Probe(int(os.environ.get("RANK", 0)), int(stop) if stop else None)
    probe.install()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` puts it first
    exit_code, error = 0, None
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop_:
        code = stop_.code
        exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        if code not in (None, 0) and not isinstance(code, int):
            error = str(code)
    except BaseException:  # noqa: BLE001 - the report must say what ended the rank, whatever it was
        exit_code, error = 1, traceback.format_exc()
    probe.write(exit_code, error)
    if error:
        print(error, file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
