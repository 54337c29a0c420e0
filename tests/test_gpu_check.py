"""`make gpu-check` (scripts/gpu_check.py): on a machine without CUDA it says so and exits 0; its notebook runner
is checked here on the CPU, and its GPU steps under the `gpu` marker."""

from pathlib import Path

import gpu_check  # scripts/ is on sys.path (tests/conftest.py)
import nbformat
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_0(capsys):
    assert gpu_check.main([]) == 0
    assert "no CUDA device on this machine" in capsys.readouterr().out


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        gpu_check.main(["--steps", "node,warp"])
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--steps", "mfu"])


def test_every_notebook_runs_once_and_graded_ones_from_solutions():
    sources = gpu_check.notebook_sources()
    assert len(sources) == len(list((REPO_ROOT / "notebooks").glob("*/*.ipynb")))
    for path in sources:
        graded = any(c.metadata.get("nbgrader", {}).get("grade") for c in nbformat.read(path, as_version=4).cells)
        assert path.parts[-3] == ("solutions" if graded else "notebooks"), path


@pytest.mark.slow
def test_the_notebook_runner_passes_the_device_parameter(tmp_path, monkeypatch):
    # A notebook with the course's parameter conventions (device, out_dir, test_parameters): running a lesson
    # here would repeat tests/course/test_notebooks.py, which executes every one of them.
    source = tmp_path / "session_x" / "01_device.ipynb"
    source.parent.mkdir()
    parameters = nbformat.v4.new_code_cell('device = "auto"\nsteps = 100\nout_dir = "runs/x"')
    parameters.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[parameters, nbformat.v4.new_code_cell(
        "import os\nassert device == 'cpu' and steps == 2 and os.path.isabs(out_dir), (device, steps, out_dir)")])
    nb.metadata["course"] = {"test_parameters": {"steps": 2}}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, source)
    monkeypatch.setattr(gpu_check, "notebook_sources", lambda: [source])
    rows = gpu_check.run_notebooks("cpu", only=["session_x/01_device"], out_dir=tmp_path / "out")
    assert [(r["notebook"], r["status"], r["on"]) for r in rows] == [("session_x/01_device", "passed", "cpu")]
    executed = nbformat.read(tmp_path / "out" / "01_device.ipynb", as_version=4)
    injected = next(c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert "device = \"cpu\"" in injected.source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt2_small_mfu_is_measured_on_the_gpu():
    result = gpu_check.gpt2_small_mfu(batch_size=4, steps=2, compile_model=False)
    assert result["tokens_per_s"] > 0 and result["achieved_tflops"] > 0
    assert result["mfu"] is None or 0 < result["mfu"] < 1
