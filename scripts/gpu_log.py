"""Reading the output of `make gpu-check` (scripts/gpu_check.py), as kept in book/gpu/measured/*.log.

    python scripts/gpu_log.py book/gpu/measured/gpu_check_h100.log     # what the log says ran, in the book's words

A log may hold several calls one after the other; for each notebook the last line wins, as it is the notebook's
last result on that node. Both table layouts the logs hold are read: gpu_check's own (`name  seconds s  run as
result`) and the summary table of the H200 log (`name  at a time  seconds  on  result  <- earlier results`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

NOTEBOOK_ROW = re.compile(
    r"^  (?P<notebook>session_\w+/\w+)\s+(?:(?P<jobs>\d+)\s+(?P<seconds_a>\d+\.\d)|(?P<seconds_b>\d+\.\d) s)"
    r"\s+(?P<on>\S.*?)\s+(?P<status>passed|FAILED\b.*?|not run\b.*?)(?:\s+<- (?P<earlier>.*))?$")
MATMUL = re.compile(r"^  bf16 matmul\s+(?P<tflops>\d+) TFLOP/s \((?P<shape>\d+ x \d+ x \d+), mean of (?P<repeats>\d+)")
MFU = re.compile(
    r"GPT-2 small \((?P<params>\d+)M\), bf16, batch (?P<batch>\d+) x (?P<seq>\d+), (?P<mode>torch\.compile|eager) "
    r"on (?P<card>.+?): (?P<tokens_per_s>[\d,]+) tokens/s, (?P<tflops>[\d.]+) TFLOP/s achieved, "
    r"MFU (?:(?P<mfu>[\d.]+)% of (?P<peak>\d+) TFLOP/s|unknown)")
TRAIN = re.compile(r"^  (?P<run>one GPU, bf16|torchrun, \d+ GPU\(s\), bf16)\s+(?P<seconds>\d+\.\d) s  (?P<status>.*)$")
PYTEST = re.compile(r"^  pytest -m (?P<marker>gpu|multigpu): (?P<summary>.*)$")
MULTIGPU_SKIPPED = re.compile(r"^  multigpu: skipped: (?P<gpus>\d+) GPU\(s\)$")
NODE = re.compile(r"^  (?P<key>torch CUDA|torch|NCCL|GPUs|CPU cores|nvidia-smi)\s{2,}(?P<value>\S.*)$")
PROFILE_HEADER = re.compile(r"the operators with the most GPU time over (?P<steps>\d+) steps")
PROFILE_TOTAL = re.compile(r"^Self CUDA time total: (?P<ms>[\d.]+)ms$")
SPLIT_ROW = re.compile(r"^    (?P<kind>matrix products|attention|cross entropy|optimizer|element-wise and other)\s+"
                       r"(?P<ms>[\d.]+) ms\s+(?P<share>[\d.]+)%")
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")
"""A number as a reader sees it: 545,990 and 545990 are the same number (see numbers())."""


@dataclass
class ProfileRow:
    name: str
    self_cuda_ms: float
    self_cuda_share: float
    calls: int


@dataclass
class Profile:
    batch: int | None
    steps: int
    rows: list[ProfileRow] = field(default_factory=list)
    total_ms: float | None = None

    def row(self, name: str) -> ProfileRow | None:
        """The first row of that name: the table's rows come sorted by GPU time."""
        return next((r for r in self.rows if r.name == name), None)


@dataclass
class GpuLog:
    text: str
    notebooks: dict[str, dict] = field(default_factory=dict)
    """{notebook: its last row}: seconds, on, status, earlier (the H200 table's earlier results) and all (every row)."""
    matmul: list[dict] = field(default_factory=list)
    mfu: list[dict] = field(default_factory=list)
    train: list[dict] = field(default_factory=list)
    pytest: dict[str, list[str]] = field(default_factory=dict)
    multigpu_skipped: list[int] = field(default_factory=list)
    node: dict[str, list[str]] = field(default_factory=dict)
    profiles: list[Profile] = field(default_factory=list)
    splits: list[dict[str, tuple[float, float]]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Of the notebooks the log ran (last result of each): how many, how many passed and failed."""
        ran = [row for row in self.notebooks.values() if not row["status"].startswith("not run")]
        passed = sum(row["status"] == "passed" for row in ran)
        return {"ran": len(ran), "passed": passed, "failed": len(ran) - passed}


def _profile_row(line: str) -> ProfileRow | None:
    """One row of torch.profiler's table: a 60-character name, then its ten columns (Self CUDA is the sixth)."""
    fields = line[60:].split()
    if len(fields) != 10 or not fields[-1].isdigit():
        return None
    ms = float(fields[5][:-2]) if fields[5].endswith("ms") else float(fields[5][:-2]) / 1e3
    return ProfileRow(line[:60].strip(), ms, float(fields[6].rstrip("%")), int(fields[9]))


def parse(text: str) -> GpuLog:
    """Everything the tests of the book's GPU page check, from one log."""
    log = GpuLog(text)
    profile = None
    for line in text.splitlines():
        if m := NOTEBOOK_ROW.match(line):
            seconds = float(m["seconds_a"] or m["seconds_b"])
            earlier = log.notebooks.get(m["notebook"], {}).get("all", [])
            row = {"seconds": seconds, "on": m["on"], "status": m["status"].strip(), "earlier": m["earlier"]}
            log.notebooks[m["notebook"]] = {**row, "all": [*earlier, row]}
        elif m := MATMUL.match(line):
            log.matmul.append(m.groupdict())
        elif m := MFU.search(line):
            log.mfu.append(m.groupdict())
        elif m := TRAIN.match(line):
            log.train.append(m.groupdict())
        elif m := PYTEST.match(line):
            log.pytest.setdefault(m["marker"], []).append(m["summary"])
        elif m := MULTIGPU_SKIPPED.match(line):
            log.multigpu_skipped.append(int(m["gpus"]))
        elif m := NODE.match(line):
            log.node.setdefault(m["key"], []).append(m["value"])
        elif m := PROFILE_HEADER.search(line):
            profile = Profile(int(log.mfu[-1]["batch"]) if log.mfu else None, int(m["steps"]))
            log.profiles.append(profile)
        elif m := SPLIT_ROW.match(line):
            if not log.splits or m["kind"] in log.splits[-1]:
                log.splits.append({})
            log.splits[-1][m["kind"]] = (float(m["ms"]), float(m["share"]))
        elif profile is not None and (m := PROFILE_TOTAL.match(line)):
            profile.total_ms = float(m["ms"])
            profile = None
        elif profile is not None and (row := _profile_row(line)):
            profile.rows.append(row)
    return log


def read(path: str | Path) -> GpuLog:
    return parse(Path(path).read_text())


def run_as(on: str, ranks: int | None = None) -> str:
    """A log's "on" column in the words of gpu_check's "run as" (the older logs used other words).

    ranks: how many ranks the notebook starts (gpu_check.notebook_ranks); with 0, the older logs' "cuda (ranks on
    gloo)" means one process on the GPU, which had no ranks to put on gloo."""
    if on == "cuda (ranks on gloo)":
        return "cuda, one process" if ranks == 0 else "cuda/gloo"
    if on == "CPU (no device parameter)":
        return "cpu (no device parameter)"
    if m := re.fullmatch(r"cpu: send/recv, (\d+) ranks > (\d+) GPU\(s\)", on):
        return f"cpu (send/recv: {m[1]} ranks > {m[2]} GPU(s))"
    return on


def numbers(text: str) -> set[str]:
    """The numbers in a text, thousands separators dropped: '81,559 MiB' and '81559 MiB' both give '81559'."""
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def main(argv=None) -> None:
    for path in argv if argv is not None else sys.argv[1:]:
        log = read(path)
        counts = log.counts()
        print(f"{path}: {counts['passed']} of {counts['ran']} notebooks passed")
        for name, row in log.notebooks.items():
            print(f"  {name:<44} {run_as(row['on']):<34} {row['status'][:40]:<40} {row['seconds']:>7.1f} s")


if __name__ == "__main__":
    main()
