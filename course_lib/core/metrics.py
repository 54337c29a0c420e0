"""The one metrics logger: one JSON object per line in out_dir/metrics.jsonl, the same scalars in TensorBoard and,
if asked, in an offline Weights & Biases run (out_dir/wandb: no account, no network; `wandb sync` uploads it later).

JSON Lines because a crashed run keeps every line written before the crash (each line is flushed),
any tool reads it (`read_metrics`, pandas.read_json(lines=True), jq), and floats keep every bit: Python
writes the shortest repr that parses back to the same float. TensorBoard event files go to out_dir/tb:

    tensorboard --logdir runs/      # then open http://localhost:6006

Every record has a "kind" ("train", "eval", ...) and a "step"; TensorBoard tags are "<kind>/<name>".
When a run resumes from step N, records after step N (written after that checkpoint, before the run
stopped) are dropped, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
WANDB_REQUIREMENT = "wandb==0.31.0"


def _jsonable(value):
    # JSON has no NaN/inf; write them as strings rather than producing a file other tools reject.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):  # 0-d tensors / numpy scalars
        return _jsonable(value.item())
    return value


class MetricsLogger:
    """Append records to out_dir/metrics.jsonl (flushed per line), to TensorBoard in out_dir/tb and, with wandb,
    to an offline W&B run in out_dir/wandb.

    resume_step=None starts fresh (empties metrics.jsonl, deletes old TensorBoard event files in out_dir/tb);
    resume_step=N keeps the records with step <= N and appends.
    wandb: False (never), "auto" (if the package is installed; one line says so otherwise) or True (required).
    config: the run's settings, shown in TensorBoard's text tab and W&B's config. Use as a context manager, or
    call close(). In a job of many ranks, log from rank 0 only.
    """

    def __init__(self, out_dir, tensorboard: bool = True, resume_step: int | None = None,
                 filename: str = METRICS_FILE, *, wandb: bool | str = False, config: dict | None = None,
                 project: str = "course", run_name: str | None = None):
        if wandb not in ("auto", True, False):
            raise ValueError(f"wandb must be 'auto', True or False, got {wandb!r}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / filename
        if resume_step is None:  # a fresh run replaces the previous one's records
            self.path.write_text("")
            for old in (self.out_dir / "tb").glob("events.out.tfevents.*"):
                old.unlink()
        elif self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:  # tensorboard is optional for the library; the course pins it
                warnings.warn(f"TensorBoard logging disabled: {err}")
            else:
                # purge_step hides events after the resume point that an earlier attempt wrote.
                purge = None if resume_step is None else resume_step + 1
                self.writer = SummaryWriter(log_dir=str(self.out_dir / "tb"), purge_step=purge)
        self.wandb_run = _start_wandb(wandb, self.out_dir, config, project, run_name)
        if config and self.writer is not None:
            self.writer.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "))

    @property
    def tensorboard_dir(self) -> Path:
        return self.out_dir / "tb"

    @property
    def wandb_dir(self) -> Path | None:
        """The offline W&B run's folder (out_dir/wandb/offline-run-...), None without one."""
        return None if self.wandb_run is None else Path(self.wandb_run.dir).parent

    def log(self, record: dict) -> None:
        """Write one record, e.g. {"kind": "train", "step": 3, "loss": 2.1}. Numbers also go to TensorBoard."""
        if "step" not in record:
            raise ValueError(f"a metrics record needs a 'step', got keys {sorted(record)}")
        record = {key: _jsonable(value) for key, value in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.writer is not None:
            kind = record.get("kind", "train")
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{kind}/{key}", value, global_step=record["step"])
        if self.wandb_run is not None:
            kind = record.get("kind", "train")
            self.wandb_run.log({f"{kind}/{k}": float(v) for k, v in record.items() if k not in ("kind", "step")
                                and isinstance(v, (int, float)) and not isinstance(v, bool)}, step=record["step"])

    def log_scalars(self, step: int, kind: str = "train", **scalars: float) -> None:
        """Scalars under the tags '<kind>/<name>': log_scalars(10, loss=2.3) writes train/loss at step 10."""
        self.log({"kind": kind, "step": step, **scalars})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish()
            self.wandb_run = None
            # finish() leaves wandb's service process (wandb-core) running for later runs; stop it, so a
            # notebook, a test or a rank leaves no process behind (the next run starts a new one).
            wandb.teardown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _start_wandb(wanted, out_dir: Path, config, project: str, run_name: str | None):
    """An offline W&B run writing to out_dir/wandb, or None (not wanted, or "auto" without the package)."""
    if wanted is False:
        return None
    try:
        import wandb as wandb_lib
    except ImportError as err:
        if wanted is True:
            raise ImportError(f"W&B logging needs the wandb package: pip install {WANDB_REQUIREMENT} "
                              "(or pass wandb=False)") from err
        print(f"W&B logging off: wandb is not installed (pip install {WANDB_REQUIREMENT}); "
              f"TensorBoard and metrics.jsonl are still written to {out_dir}")
        return None
    settings = wandb_lib.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True, save_code=False)
    # mode="offline": everything goes to files under out_dir/wandb; `wandb sync` uploads them later.
    return wandb_lib.init(project=project, name=run_name, config=config or {}, dir=str(out_dir), mode="offline",
                          settings=settings, reinit="create_new")


def read_metrics(path, kind: str | None = None) -> list[dict]:
    """Records of a metrics.jsonl file (or a run directory holding one), optionally only one kind.

    A last line cut short by a crash is skipped; a bad line elsewhere raises an error naming its number.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}, line {number} is not valid JSON: {err}") from err
        if kind is None or record.get("kind") == kind:
            records.append(record)
    return records
