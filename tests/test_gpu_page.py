"""The GPU-node page says what its logs say: book/gpu_node.md's section "What has run on a GPU" against
book/gpu/measured/gpu_check_h100.log and gpu_check_h200.log (read by scripts/gpu_log.py).

Every notebook row is the last result of that notebook in each node's log, every count is the log's, every row
of the node table and of the profile table is the log's line, every number of those tables occurs in that node's
log, and the section's other figures are either in a log or computed here from the logs (and from the model, for
the count of its matrix products). An edited figure without a log line behind it fails (the last test edits some).
"""

from __future__ import annotations

import re
from pathlib import Path

import gpu_check  # scripts/ is on sys.path (tests/conftest.py)
import gpu_log
import nbformat
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGE = REPO_ROOT / "book" / "gpu_node.md"
LOGS = {"H100": REPO_ROOT / "book" / "gpu" / "measured" / "gpu_check_h100.log",
        "H200": REPO_ROOT / "book" / "gpu" / "measured" / "gpu_check_h200.log"}
SECTION = "## What has run on a GPU"
PINNED_TORCH = "2.13.0"
"""The course's torch (requirements.txt), which the page names as the one the nodes did not have."""


@pytest.fixture(scope="module")
def logs() -> dict[str, gpu_log.GpuLog]:
    return {node: gpu_log.read(path) for node, path in LOGS.items()}


@pytest.fixture(scope="module")
def ranks() -> dict[str, int]:
    """{notebook: ranks it starts} for every notebook of the course, in gpu_check's order."""
    out = {}
    for path in gpu_check.notebook_sources():
        out[f"{path.parent.name}/{path.stem}"] = gpu_check.notebook_ranks(nbformat.read(path, as_version=4))
    return out


@pytest.fixture(scope="module")
def model_facts() -> dict[str, int]:
    """What the profile paragraph counts of GPT-2 small, from the model itself (built without memory)."""
    from course_lib.core.model import GPT, GPTConfig

    config = GPTConfig.from_preset("gpt2-small")
    with torch.device("meta"):
        model = GPT(config)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    return {"linears": linears, "n_layer": config.n_layer, "per_block": (linears - 1) // config.n_layer,
            "matmul_flops_per_token": gpu_check.matmul_flops_per_token(model)}


def section(page: str) -> str:
    start = page.index(SECTION)
    end = page.find("\n## ", start + len(SECTION))
    return page[start:end if end != -1 else None]


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of a text: each a list of rows (header first, no separator), each a list of cells."""
    found, current = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if all(re.fullmatch(r"-+", c) for c in cells):
                continue
            if current is None:
                current = []
                found.append(current)
            current.append(cells)
        else:
            current = None
    return found


def node_of(header: str) -> str:
    node = header.split()[0].rstrip(",")
    assert node in LOGS, f"a column of the page's tables is headed {header!r}: which log is that?"
    return node


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


# ------------------------------------------------------------------------------------------ the checks
def check_notebook_table(page: str, logs: dict, ranks: dict) -> None:
    table = next(t for t in tables(section(page)) if t[0][0] == "notebook")
    header, rows = table[0], table[1:]
    assert header[1] == "run as", header
    nodes = [node_of(h) for h in header[2:]]
    names = [row[0].strip("`") for row in rows]
    assert names == list(ranks), "one row per notebook of the course, in the course's order"
    for name, row in zip(names, rows):
        seen = []
        for node, cell in zip(nodes, row[2:]):
            last = logs[node].notebooks.get(name)
            if last is None:
                assert cell == "not run", f"{name} on the {node}: the log has no line for it, the page says {cell!r}"
                continue
            status = "passed" if last["status"] == "passed" else "FAILED"
            assert cell == f"{status}, {last['seconds']:.1f} s", f"{name} on the {node}: log {last}, page {cell!r}"
            seen.append(gpu_log.run_as(last["on"], ranks[name]))
        assert row[1] == (seen[0] if seen else "—"), f"{name}: run as {row[1]!r}, the logs say {seen}"
        assert len(set(seen)) <= 1, f"{name} ran differently on the two nodes ({seen}): the table needs a column each"


def check_node_table(page: str, logs: dict) -> None:
    table = next(t for t in tables(section(page)) if t[0][0] == "")
    nodes = [node_of(h) for h in table[0][1:]]
    gpt_row = ""
    for row in table[1:]:
        what = row[0]
        gpt_row = what if what.startswith("GPT-2 small") else gpt_row
        for node, cell in zip(nodes, row[1:]):
            log = logs[node]
            where = f"{what!r} on the {node}: {cell!r}"
            if what.startswith("`nvidia-smi`"):
                assert {cell} == set(log.node["nvidia-smi"]), where
            elif what == "GPUs":
                assert {cell} == set(log.node["GPUs"]), where
            elif what == "torch, its CUDA, NCCL":
                assert cell == f"{log.node['torch'][-1]}, {log.node['torch CUDA'][-1]}, {log.node['NCCL'][-1]}", where
            elif what.startswith("bf16 matrix product"):
                shape, repeats = re.search(r"(\d+ x \d+ x \d+), mean of (\d+)", what).groups()
                assert all(m["shape"] == shape and m["repeats"] == repeats for m in log.matmul), where
                assert re.findall(r"\d+(?= and| TFLOP/s)", cell) == [m["tflops"] for m in log.matmul], where
            elif what.startswith(("`python -m course_lib.train`", "the same under `torchrun`")):
                runs = [t for t in log.train if t["run"].startswith("one GPU" if "course_lib" in what else "torchrun")]
                assert runs and all(t["status"] == "passed" for t in runs) and cell.startswith("passed, "), where
                assert re.findall(r"(\d+\.\d) s", cell) == [t["seconds"] for t in runs], where
                if "torchrun" in what:
                    gpus = re.search(r"(\d+) GPU\(s\)", what)[1]
                    assert all(t["run"] == f"torchrun, {gpus} GPU(s), bf16" for t in runs), where
            elif what.startswith("`pytest -m "):
                marker = what.split()[2].rstrip("`")
                summaries = log.pytest.get(marker, [])
                if marker == "multigpu" and log.multigpu_skipped:
                    summaries += [f"skipped: {n} GPU(s)" for n in log.multigpu_skipped]
                if not summaries:
                    assert cell == "not run", where
                    continue
                last = summaries[-1]
                passed, seconds = re.search(r"(\d+) passed", last), re.search(r" in ([\d.]+)s", last)
                if passed and seconds and not re.search(r"failed|error", last):
                    assert cell == f"{passed[1]} passed in {seconds[1]}s", where
                else:
                    assert cell == last, where
            elif what.startswith(("GPT-2 small", "the same at batch")):
                batch, seq = re.search(r"batch (\d+) x (\d+)", what).groups()
                runs = [m for m in log.mfu if (m["batch"], m["seq"]) == (batch, seq)]
                if not runs:
                    assert cell == "not run", where
                    continue
                m = runs[-1]
                described = gpt_row if what.startswith("the same") else what  # "the same" as the row above
                assert ("`torch.compile`" in described) == (m["mode"] == "torch.compile"), where
                assert f"GPT-2 small ({m['params']}M), bf16" in described, where
                assert cell == (f"{m['tokens_per_s']} tokens/s, {m['tflops']} TFLOP/s, "
                                f"MFU {m['mfu']}% of {m['peak']} TFLOP/s"), where
            elif what.startswith("notebooks"):
                counts = log.counts()
                assert cell == f"{counts['passed']} of {counts['ran']} passed", f"{where}; the log: {counts}"
            else:
                raise AssertionError(f"the node table has a row no check reads against the log: {what!r}")


def check_profile_table(page: str, logs: dict) -> None:
    table = next(t for t in tables(section(page)) if t[0][0].startswith("operator"))
    steps = {"three": 3}[re.search(r"operator, (\w+) steps", table[0][0])[1]]
    profiles = {}
    for header in table[0][1:]:
        node, batch = node_of(header), int(re.search(r"batch (\d+) x 1024", header)[1])
        profile = next(p for p in logs[node].profiles if p.batch == batch)
        assert profile.steps == steps, header
        profiles[header] = profile
    for row in table[1:]:
        for header, cell in zip(table[0][1:], row[1:]):
            profile = profiles[header]
            if row[0] == "Self CUDA time total":
                assert cell == f"{profile.total_ms:.3f} ms", (header, cell)
                continue
            listed = profile.row(row[0].strip("`"))
            if listed is None:
                assert cell == "not listed", (row[0], header, cell)
            else:
                assert cell == f"{listed.self_cuda_ms:.3f} ms, {listed.self_cuda_share:.2f}%, {listed.calls} calls", (
                    row[0], header, cell, listed)


def derived_figures(logs: dict, model_facts: dict) -> dict[str, str]:
    """{phrase of the profile paragraph: why}: every figure in it that the logs do not hold as such, computed here."""
    h100 = next(p for p in logs["H100"].profiles if p.batch == 32)
    h200 = next(p for p in logs["H200"].profiles if p.batch == 16)
    per_step = 3 * model_facts["linears"]  # each Linear: one product forward, two backward
    flops = model_facts["matmul_flops_per_token"]

    def share(profile, *names):
        return sum(profile.row(n).self_cuda_share for n in names)

    attention = ("aten::_cudnn_attention_backward", "aten::_cudnn_attention_forward")
    log_softmax = ("triton_poi_fused__log_softmax__log_softmax_backward_data_...",
                   "triton_red_fused__log_softmax__to_copy__unsafe_view_clone...")
    mm200, mm100 = h200.row("aten::mm"), h100.row("aten::mm")
    assert mm200.calls == h200.steps * per_step, "on the H200 aten::mm is every matrix product"
    rate200 = flops * h200.batch * 1024 * h200.steps / (mm200.self_cuda_ms / 1e3) / 1e12
    rate100 = flops * h100.batch * 1024 * h100.steps / (mm100.self_cuda_ms / 1e3) / 1e12
    matmul200 = [int(m["tflops"]) for m in logs["H200"].matmul]
    peak100 = int(logs["H100"].mfu[-1]["peak"])
    assert rate200 < min(matmul200) and rate100 > peak100, "the paragraph's 'below' and 'above'"
    listed200 = {"mm": mm200.self_cuda_share, "attention": share(h200, *attention),
                 "log_softmax": share(h200, *log_softmax), "adam": share(h200, "Optimizer.step#AdamW.step")}
    counts = {node: log.counts() for node, log in logs.items()}
    assert len({len(p.rows) for log in logs.values() for p in log.profiles}) == 1
    return {
        **{f"{c['passed']} of {c['ran']} passed": f"{node} log's notebook lines" for node, c in counts.items()},
        f"the {len(h100.rows)} operators with the most GPU time": "profile tables",
        f"One step of GPT-2 small runs {per_step} matrix products: {model_facts['linears']} in the forward pass "
        f"({model_facts['per_block']} in each of the {model_facts['n_layer']} blocks and the output layer)": "model",
        f"`aten::mm` lists {mm200.calls} calls over the three steps, {mm200.calls // 3} a step": "H200 profile",
        f"{flops:,} per token; for 3 x {h200.batch} x 1024 tokens in {mm200.self_cuda_ms:.3f} ms that is "
        f"{rate200:.0f} TFLOP/s, below the {matmul200[0]} and {matmul200[1]} TFLOP/s": "H200 profile and matmul",
        f"There, the matrix products took {listed200['mm']:.0f}% of the GPU time, cuDNN's flash attention "
        f"{listed200['attention']:.1f}%, the log-softmax of the cross entropy {listed200['log_softmax']:.1f}%, "
        f"AdamW {listed200['adam']:.1f}%, and the other {100 - sum(listed200.values()):.0f}%": "H200 profile",
        f"`aten::mm` lists {mm100.calls} calls, {mm100.calls // 3} a step: the other "
        f"{per_step - mm100.calls // 3} matrix products": "H100 profile",
        f"its {mm100.self_cuda_ms:.3f} ms would mean {rate100:,.0f} TFLOP/s, above the card's {peak100} peak, so its "
        f"{mm100.self_cuda_share:.2f}% is not the matrix products' share": "H100 profile and MFU line",
        f"flash attention {share(h100, *attention):.1f}% and the log-softmax {share(h100, *log_softmax):.1f}%":
            "H100 profile",
    }


def check_derived_figures(page: str, logs: dict, model_facts: dict) -> None:
    text = flat(section(page))
    for phrase, source in derived_figures(logs, model_facts).items():
        assert phrase in text, f"the page should say, from the {source}: {phrase!r}"


def check_table_numbers(page: str, logs: dict) -> None:
    """Every number in a node's column of the measured tables occurs in that node's log; in the first column, in
    one of the logs. The notebook counts ('27 of 29 passed') are the log's counts, checked by check_node_table."""
    everywhere = set().union(*(gpu_log.numbers(log.text) for log in logs.values()))
    for table in tables(section(page)):
        nodes = [(h.split() or [""])[0].rstrip(",") for h in table[0]]
        for row in table[1:]:
            for column, cell in enumerate(row):
                cell = re.sub(r"`[^`]*`", "", re.sub(r"^\d+ of \d+ passed$", "", cell))
                known = gpu_log.numbers(logs[nodes[column]].text) if nodes[column] in logs else everywhere
                missing = gpu_log.numbers(cell) - known
                assert not missing, f"{missing} in {row[0]!r} ({table[0][column] or 'first column'}): in no log line"


def check_section_numbers(page: str, logs: dict, model_facts: dict) -> None:
    """The section has no number that is not in a log, computed from them (derived_figures), or the course's
    pinned torch."""
    known = set().union(*(gpu_log.numbers(log.text) for log in logs.values()))
    known |= set().union(*map(gpu_log.numbers, derived_figures(logs, model_facts)))
    known |= gpu_log.numbers(PINNED_TORCH)
    # Code without a space is a name (session_b/03_torch_ddp, cuda:1); code with one, a command or a quote, counts.
    text = re.sub(r"`[^`\s]*`", "", re.sub(r"\{download\}`[^`]*`", "", section(page)))
    missing = gpu_log.numbers(text) - known
    assert not missing, f"numbers on the GPU page that no log line holds: {sorted(missing)}"


def check_page(page: str, logs: dict, ranks: dict, model_facts: dict) -> None:
    check_notebook_table(page, logs, ranks)
    check_node_table(page, logs)
    check_profile_table(page, logs)
    check_derived_figures(page, logs, model_facts)
    check_table_numbers(page, logs)
    check_section_numbers(page, logs, model_facts)


# ------------------------------------------------------------------------------------------ the tests
def test_the_page_links_both_logs_and_they_name_no_folder_of_the_nodes():
    text = PAGE.read_text()
    for path in LOGS.values():
        assert f"{{download}}`{path.relative_to(PAGE.parent).as_posix()}`" in text
        log = path.read_text()
        assert "/tmp/" not in log and "/home/" not in log, f"{path.name}: a temporary folder of the node"
    assert PINNED_TORCH in (REPO_ROOT / "requirements.txt").read_text()


def test_the_logs_are_read_whole(logs):
    # The parser must see what the page shows: a silent miss would make every comparison vacuous.
    assert [len(logs[n].notebooks) for n in LOGS] == [29, 30]
    assert logs["H100"].notebooks["session_b/03_torch_ddp"]["status"].startswith("FAILED"), "the last line wins"
    assert [len(p.rows) for n in LOGS for p in logs[n].profiles] == [25, 25]
    assert all(logs[n].mfu and logs[n].matmul and logs[n].train and logs[n].pytest["gpu"] for n in LOGS)


def test_every_notebook_row_is_its_last_result_in_each_log(logs, ranks):
    check_notebook_table(PAGE.read_text(), logs, ranks)


def test_every_row_of_the_node_table_is_the_logs_line_and_the_counts_are_the_logs(logs):
    check_node_table(PAGE.read_text(), logs)


def test_the_profile_table_is_the_logs_and_its_figures_are_computed_from_them(logs, model_facts):
    check_profile_table(PAGE.read_text(), logs)
    check_derived_figures(PAGE.read_text(), logs, model_facts)


def test_every_number_of_the_section_is_in_a_log(logs, model_facts):
    check_table_numbers(PAGE.read_text(), logs)
    check_section_numbers(PAGE.read_text(), logs, model_facts)


def test_the_mfu_peak_of_the_logs_is_the_peak_table_of_their_card(logs):
    from course_lib.observability.profiling import gpu_peak_flops

    for log in logs.values():
        for line in log.mfu:
            assert gpu_peak_flops(line["card"]) == int(line["peak"]) * 1e12, line


EDITS = [
    ("466.7 TFLOP/s", "476.7 TFLOP/s"),  # a figure of the node table
    ("27 of 29 passed", "28 of 29 passed"),  # a count
    ("| passed, 14.6 s |", "| passed, 14.9 s |"),  # a notebook's time
    ("| FAILED, 175.8 s |", "| passed, 175.8 s |"),  # a notebook's result
    ("| `session_c/06_debugging_lab` | cpu (no device parameter) | not run |",
     "| `session_c/06_debugging_lab` | cpu (no device parameter) | passed, 158.1 s |"),  # a run the log lacks
    ("| cuda, one process | passed, 11.7 s", "| cuda/NCCL | passed, 11.7 s"),  # how it ran
    ("51.941 ms, 54.04%", "51.941 ms, 44.04%"),  # the profile table
    ("that is 702 TFLOP/s", "that is 712 TFLOP/s"),  # a figure computed from the log
    ("| `pytest -m multigpu` | not run | not run |", "| `pytest -m multigpu` | 4 passed in 9.1s | not run |"),
    ("| GPUs | 1 | 1 |", "| GPUs | 1 | 1 |\n| NCCL all-reduce, 2 GPUs | 350 GB/s | not run |"),  # a new row
    ("MFU is a fraction of 989 TFLOP/s", "MFU is a fraction of 999 TFLOP/s"),  # a number in the prose
]


@pytest.mark.parametrize("old, new", EDITS, ids=[new[:30] for _, new in EDITS])
def test_a_figure_edited_without_a_log_line_fails(logs, ranks, model_facts, old, new):
    page = PAGE.read_text()
    assert page.count(old) == 1, f"the page no longer says {old!r}: choose another edit"
    with pytest.raises(AssertionError):
        check_page(page.replace(old, new), logs, ranks, model_facts)
