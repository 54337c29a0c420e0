"""`make gpu-check` (scripts/gpu_check.py): on a machine without CUDA it says so and exits 0; its notebook runner,
its choice of backend per notebook, the multigpu step, the profile split and the lines it prints (which
scripts/gpu_log.py must read back) are checked here on the CPU, and its GPU steps under the `gpu` marker."""

import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import gpu_check  # scripts/ is on sys.path (tests/conftest.py)
import gpu_log
import nbformat
import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from course_lib.core.model import GPT, GPTConfig

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
    monkeypatch.setattr(gpu_check, "notebook_sources", lambda missing=None: [source])
    rows = gpu_check.run_notebooks("cpu", only=["session_x/01_device"], out_dir=tmp_path / "out")
    assert [(r["notebook"], r["status"], r["on"]) for r in rows] == [
        ("session_x/01_device", "passed", "cpu (--device cpu)")]
    executed = nbformat.read(tmp_path / "out" / "01_device.ipynb", as_version=4)
    injected = next(c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert "device = \"cpu\"" in injected.source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt2_small_mfu_is_measured_on_the_gpu():
    result = gpu_check.gpt2_small_mfu(batch_size=4, steps=2, compile_model=False)
    assert result["tokens_per_s"] > 0 and result["achieved_tflops"] > 0
    assert result["mfu"] is None or 0 < result["mfu"] < 1


# ------------------------------------------------------------------------------------------ run as
def notebook(parameters: str | None, test_parameters: dict | None = None):
    cells = []
    if parameters is not None:
        cells.append(nbformat.v4.new_code_cell(parameters))
        cells[0].metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["course"] = {"test_parameters": test_parameters or {}}
    return nb


@pytest.mark.parametrize("parameters, test_parameters, gpus, name, want", [
    (None, {}, 8, "s/x", ("cpu (no device parameter)", {})),
    ("seed = 0", {}, 8, "s/x", ("cpu (no device parameter)", {})),
    ('device = "auto"\nsteps = 3', {}, 0, "s/x", ("cuda, one process", {"device": "cuda"})),
    ('world_size = 2\ndevice = "cpu"', {}, 2, "s/x", ("cuda/NCCL", {"device": "cuda"})),
    ('world_size = 2\ndevice = "cpu"', {}, 1, "s/x",
     ("cuda/gloo (2 ranks > 1 GPU(s))", {"device": "cuda", "COURSE_BACKEND": "gloo"})),
    ('world_size = 2\nworld_sizes = [1, 2, 4]\nfailure_world_size = 3\ndevice = "cpu"', {"world_sizes": [1, 2]}, 2,
     "s/x", ("cuda/gloo (3 ranks > 2 GPU(s))", {"device": "cuda", "COURSE_BACKEND": "gloo"})),
    ('collective_ranks = 4\ndevice = "cpu"', {"collective_ranks": 2}, 4, "s/x", ("cuda/NCCL", {"device": "cuda"})),
    ('nnodes = 2\nnproc_per_node = 2\ndevice = "cpu"', {}, 2, "s/x",
     ("cuda/gloo (4 ranks > 2 GPU(s))", {"device": "cuda", "COURSE_BACKEND": "gloo"})),
    ('world_size = 2\ndevice = "cpu"', {}, 1, "session_e/02_pipeline_parallel",
     ("cpu (send/recv: 2 ranks > 1 GPU(s))", {"device": "cpu"})),
    ('world_size = 2\ndevice = "cpu"', {}, 2, "session_e/02_pipeline_parallel", ("cuda/NCCL", {"device": "cuda"})),
])
def test_run_as_gives_nccl_only_with_a_gpu_per_rank(parameters, test_parameters, gpus, name, want):
    nb = notebook(parameters, test_parameters)
    assert gpu_check.run_as(name, nb, dict(test_parameters), "cuda", gpus) == want


def test_run_as_on_the_cpu_and_with_a_backend_the_caller_chose():
    nb = notebook('world_size = 2\ndevice = "cpu"')
    assert gpu_check.run_as("s/x", nb, {}, "cpu", 0) == ("cpu (--device cpu)", {"device": "cpu"})
    assert gpu_check.run_as("s/x", nb, {}, "cuda", 8, backend="gloo") == ("cuda/gloo (COURSE_BACKEND=gloo)",
                                                                          {"device": "cuda"})
    pipeline = "session_e/02_pipeline_parallel"  # gloo cannot send its CUDA tensors, whoever chose gloo
    assert gpu_check.run_as(pipeline, nb, {}, "cuda", 1, backend="gloo")[0] == "cpu (send/recv: 2 ranks > 1 GPU(s))"


def test_the_course_notebooks_ranks_as_their_test_parameters_set_them():
    by_name = {f"{p.parent.name}/{p.stem}": nbformat.read(p, as_version=4) for p in gpu_check.notebook_sources()
               if p.parent.name in ("session_a", "session_b")}
    ranks = {name: gpu_check.notebook_ranks(nb, nb.metadata["course"]["test_parameters"])
             for name, nb in by_name.items()}
    assert ranks["session_a/03_training_loop"] == 0 and ranks["session_b/02_ddp_from_scratch"] == 2
    assert ranks["session_b/06_lab2"] == 3, "failure_world_size = 3 is the largest of its rank counts"


def test_the_notebook_line_is_read_back_with_its_run_as():
    row = {"notebook": "session_b/06_lab2", "seconds": 67.5, "on": "cuda/gloo (3 ranks > 1 GPU(s))",
           "status": "passed"}
    log = gpu_log.parse(gpu_check.notebook_line(row) + "\n" + gpu_check.notebook_line(
        {**row, "notebook": "session_b/02b_ddp_exercises", "on": "cpu (no device parameter)", "status": "FAILED: x"}))
    read = log.notebooks["session_b/06_lab2"]
    assert (read["on"], read["seconds"], read["status"]) == (row["on"], 67.5, "passed")
    assert log.counts() == {"ran": 2, "passed": 1, "failed": 1}
    assert gpu_log.run_as(row["on"]) == row["on"], "the new words are the page's words"


# ------------------------------------------------------------------------------------------ multigpu, paths, MFU line
def test_the_multigpu_step_is_skipped_below_two_gpus_and_runs_the_marker_above(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_check.multigpu_tests() == {"returncode": 0, "skipped": True, "summary": "skipped: 1 GPU(s)"}
    assert capsys.readouterr().out == "  multigpu: skipped: 1 GPU(s)\n"
    assert gpu_log.parse("  multigpu: skipped: 1 GPU(s)").multigpu_skipped == [1]

    calls = []

    def fake_run(command, **kwargs):
        calls.append((command, kwargs["env"]["COURSE_DEVICE_GUARD"]))
        return subprocess.CompletedProcess(command, 5, stdout="\nno tests ran in 0.01s\n", stderr="")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    result = gpu_check.multigpu_tests()
    command, guard = calls[0]
    assert command[1:] == ["-m", "pytest", "-m", "multigpu", "tests/multigpu", "-q", "-rA", "-p", "no:cacheprovider"]
    assert guard == "1"
    assert result["returncode"] == 5 and not result["skipped"], "no test collected is not a pass"
    assert "  pytest -m multigpu: no tests ran in 0.01s" in capsys.readouterr().out


def test_printed_paths_name_no_folder_of_the_machine(tmp_path):
    out_dir = tmp_path / "gc"
    text = (f"checkpoint: {out_dir}/train/one/ckpt.pt; {gpu_check.REPO_ROOT}/scripts/x.py; "
            f"{tempfile.gettempdir()}/other/f; File \"/opt/v/lib/python3.12/site-packages/torch/run.py\"")
    assert gpu_check.shown(text, out_dir) == ('checkpoint: <out_dir>/train/one/ckpt.pt; scripts/x.py; <tmp>/other/f; '
                                              'File "site-packages/torch/run.py"')


def test_the_mfu_line_names_its_peak_and_source_or_says_unknown():
    line = gpu_check.mfu_line(123_587_328, 16, 1024, True, "NVIDIA H100 NVL", 400_000.0, 341.9e12)
    assert "MFU 40.9% of 835 TFLOP/s (H100 NVL dense bf16 peak; NVIDIA H100 Tensor Core GPU datasheet" in line
    parsed = gpu_log.parse(line).mfu[0]
    assert (parsed["card"], parsed["tokens_per_s"], parsed["mfu"], parsed["peak"]) == ("NVIDIA H100 NVL", "400,000",
                                                                                        "40.9", "835")
    unknown = gpu_check.mfu_line(123_587_328, 16, 1024, False, "NVIDIA RTX 9999", 1000.0, 1e12)
    assert unknown.endswith("1.0 TFLOP/s achieved, MFU unknown (no peak figure for NVIDIA RTX 9999)")
    assert gpu_log.parse(unknown).mfu[0]["mfu"] is None


# ------------------------------------------------------------------------------------------ profile split
# Rows as the profiler gives them: (kernel or operator, microseconds, the operators it ran inside, innermost first).
ROWS = [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 23468.0, ("aten::mm", "## Call CompiledFxGraph f ##")),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 100.0, ()),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", 50.0, ()),
    ("triton_tem_fused_mm_0", 30.0, ()),
    ("ampere_sgemm_128x64_tn", 20.0, ("aten::addmm", "aten::linear")),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 5.0, ("aten::mm",)),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128_4x1x1_cga1x1x1_kernel0_0", 15383.0,
     ("aten::_cudnn_attention_backward", "aten::_scaled_dot_product_cudnn_attention_backward")),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", 10.0, ("aten::_efficient_attention_forward",)),
    ("triton_poi_fused__log_softmax__log_softmax_backward_data_nll_loss_backward_0", 10002.0, ()),
    ("void at::native::cunn_SoftMaxForward<4, float, float, float, at::native::LogSoftMaxForwardEpilogue>", 7.0,
     ("aten::_log_softmax", "aten::log_softmax", "aten::cross_entropy_loss")),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", 3042.0, ("aten::_fused_adamw_",)),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 40.0,
     ("aten::_foreach_add_", "Optimizer.step#AdamW.step")),
    ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_zeros_0", 5861.0,
     ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_zeros_0", "## Call CompiledFxGraph f ##")),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", 700.0,
     ("autograd::engine::evaluate_function: MmBackward0",)),
    ("Memcpy HtoD (Pageable -> Device)", 3.0, ()),
]


def test_the_split_sums_every_row_into_one_kind():
    assert [gpu_check.row_kind(name, context) for name, _, context in ROWS] == [
        "matrix products", "matrix products", "matrix products", "matrix products", "matrix products",
        "matrix products", "attention", "attention", "cross entropy", "cross entropy", "optimizer", "optimizer",
        "element-wise and other", "element-wise and other", "element-wise and other"]
    split = gpu_check.time_split(ROWS)
    assert list(split) == list(gpu_check.SPLIT)
    assert sum(split.values()) == pytest.approx(sum(us for _, us, _ in ROWS)), "no row is lost or counted twice"
    assert split["matrix products"] == 23468 + 100 + 50 + 30 + 20 + 5
    assert gpu_check.time_split([("aten::mm", 2.0), ("aten::add", 1.0)]) == {
        "matrix products": 2.0, "attention": 0.0, "cross entropy": 0.0, "optimizer": 0.0,
        "element-wise and other": 1.0}


def test_the_split_prints_the_matrix_products_flops_and_is_read_back():
    split = {"matrix products": 97_600.0, "attention": 26_000.0, "cross entropy": 16_600.0, "optimizer": 4_000.0,
             "element-wise and other": 13_300.0}
    text = gpu_check.format_split(split, "self CUDA", 3, matmul_flops=7.2878e13)
    assert "self CUDA time of 3 steps by kind, summed over every kernel (157.500 ms in all)" in text
    assert "7.288e+13 FLOP in 97.600 ms: 746.7 TFLOP/s" in text
    assert gpu_log.parse(text).splits == [{kind: (us / 1e3, pytest.approx(100 * us / 157_500, abs=0.005))
                                           for kind, us in split.items()}]


def test_each_kernel_is_placed_inside_the_operator_that_launched_it():
    # Events as torch.profiler links them: a kernel's linked_correlation_id is the id of the operator that ran it.
    root = SimpleNamespace(name="Optimizer.step#AdamW.step", id=1, linked_correlation_id=0, cpu_parent=None,
                           device_type=DeviceType.CPU, is_user_annotation=True, self_cpu_time_total=5.0)
    mm = SimpleNamespace(name="aten::mm", id=2, linked_correlation_id=0, cpu_parent=None, device_type=DeviceType.CPU,
                         is_user_annotation=False, self_cpu_time_total=3.0)
    foreach = SimpleNamespace(name="aten::_foreach_mul_", id=3, linked_correlation_id=0, cpu_parent=root,
                              device_type=DeviceType.CPU, is_user_annotation=False, self_cpu_time_total=2.0)

    def kernel(name, op_id, us):
        return SimpleNamespace(name=name, id=op_id, linked_correlation_id=op_id, cpu_parent=None,
                               device_type=DeviceType.CUDA, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [root, mm, foreach, kernel("some_kernel_a", 2, 40.0), kernel("some_kernel_b", 3, 7.0),
              kernel("orphan_kernel", 99, 1.0)]
    what, rows = gpu_check.profile_rows(SimpleNamespace(events=lambda: events))
    assert what == "self CUDA"
    assert rows == [("some_kernel_a", 40.0, ("aten::mm",)),
                    ("some_kernel_b", 7.0, ("aten::_foreach_mul_", "Optimizer.step#AdamW.step")),
                    ("orphan_kernel", 1.0, ())]
    assert gpu_check.time_split(rows) == {"matrix products": 40.0, "attention": 0.0, "cross entropy": 0.0,
                                          "optimizer": 7.0, "element-wise and other": 1.0}


def test_the_split_of_a_real_cpu_profile_covers_every_operator(one_thread):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # AdamW's first use imports for 1 s
    idx = torch.randint(0, model.config.vocab_size, (2, 32))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, loss = model(idx, targets=idx)
        loss.backward()
        optimizer.step()
    what, rows = gpu_check.profile_rows(prof)
    assert what == "self CPU"
    every = sum(e.self_cpu_time_total for e in prof.events() if not e.is_user_annotation)
    split = gpu_check.time_split(rows)
    assert sum(split.values()) == pytest.approx(every)
    assert split["matrix products"] > 0 and split["optimizer"] > 0 and split["cross entropy"] > 0
    assert split["attention"] > 0
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert gpu_check.matmul_flops_per_token(model) == 6 * (linear_weights - model.lm_head.weight.numel()) + \
        6 * model.tok_emb.weight.numel(), "the tied lm_head counts once"


def test_without_solutions_the_graded_notebooks_are_left_out_and_counted(monkeypatch, tmp_path):
    """The learner image has no solutions/: gpu-check runs the lesson notebooks and says what it left out."""
    (tmp_path / "notebooks").symlink_to(gpu_check.REPO_ROOT / "notebooks")
    monkeypatch.setattr(gpu_check, "REPO_ROOT", tmp_path)
    missing = []
    sources = gpu_check.notebook_sources(missing)
    assert missing and all("solutions" not in p.parts for p in sources)
    assert len(sources) + len(missing) == len(list((tmp_path / "notebooks").glob("*/*.ipynb")))
