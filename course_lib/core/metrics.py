"""Training metrics: one JSON object per line in out_dir/metrics.jsonl, the same scalars in TensorBoard.

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


def _jsonable(value):
    # JSON has no NaN/inf; write them as strings rather than producing a file other tools reject.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):  # 0-d tensors / numpy scalars
        return _jsonable(value.item())
    return value


class MetricsLogger:
    """Append records to out_dir/metrics.jsonl (flushed per line) and to TensorBoard in out_dir/tb.

    resume_step=None starts fresh (empties metrics.jsonl, deletes old TensorBoard event files in out_dir/tb);
    resume_step=N keeps the records with step <= N and appends.
    Use as a context manager, or call close().
    """

    def __init__(self, out_dir, tensorboard: bool = True, resume_step: int | None = None,
                 filename: str = METRICS_FILE):
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

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
