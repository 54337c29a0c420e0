"""The cluster files in config/ against the course's own code, and run wherever this machine can run them.

    .venv/bin/python -m pytest -q tests/integrations/test_cluster_files.py
    bash scripts/local_slurm.sh start          # a real one-node Slurm (apt-get install slurm-wlm first), then:
    COURSE_REAL_SLURM=1 .venv/bin/python -m pytest -q tests/integrations/test_cluster_files.py -k real_slurm

- SLURM: the #SBATCH lines; a dry run whose launch line (as srun receives it) goes through torchrun's and
  course_lib.train's own argument parsers; real CPU runs of the unchanged files with `srun` and `scontrol`
  faked (FAKE_SRUN below starts its command once per simulated node with the SLURM_* variables a real srun
  sets; FAKE_SCONTROL expands node lists with course_lib.cluster.slurm); opt-in, the same files through a real Slurm.
  The time-limit warning: SIGUSR1 sent to the steps' processes, as Slurm's `--signal=USR1@120` does, stops the
  run with a checkpoint, the job is requeued, and the same job run again resumes there.
- Apptainer: config/slurm_apptainer.sbatch's `apptainer exec` line (binds, environment, the image's repository),
  and the job run with `apptainer` faked (FAKE_APPTAINER: the command on this machine, the binds as links).
- Kubernetes: the PyTorchJob's pods x GPUs against torchrun's flags, its command through the same parsers.
- DeepSpeed: every config through DeepSpeed's own DeepSpeedConfig at the cluster's world size, its optimizer,
  schedule and precision against the course's, and real runs under the `deepspeed` launcher.
- Accelerate: the YAML files through Accelerate's own loader; the CPU one really starts 2 processes.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from cluster.test_torchrun_multinode import (  # tests/ is on sys.path (conftest.py)
    clean_environ, kill_process_trees, run_process_tree)
from torch.distributed.run import get_args_parser as torchrun_parser

from course_lib import train as course_train
from course_lib.core.model import GPT
from course_lib.core.optim import configure_optimizer, get_lr
from course_lib.core.steps import evaluate
from course_lib.integrations.deepspeed_train import resolve_configs
from course_lib.cluster.slurm import slurm_to_torch_env
from course_lib.runtime.env import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config"
BIN = Path(sys.executable).parent
SBATCH_FILES = {"example": CONFIG / "slurm_example.sbatch", "multinode": CONFIG / "slurm_multinode.sbatch",
                "apptainer": CONFIG / "slurm_apptainer.sbatch"}
NATIVE_SBATCH = ("example", "multinode")  # the files that run the repository's .venv rather than an image
USR1_WRAPPER = ["bash", "-c", 'trap "" USR1; exec "$@"', "torchrun-ignoring-usr1"]
"""How every sbatch file starts torchrun: with SIGUSR1 ignored, which its workers inherit and then handle."""
IMAGE_REPO = "/home/course/course"  # the repository in the image (the Dockerfile's WORKDIR)
DEEPSPEED_MISSING = "DeepSpeed is not installed: make venv EXTRAS=deepspeed"
DEEPSPEED_FILES = sorted(CONFIG.glob("deepspeed_*.json"))
TINY_RUN = ("--model_size tiny --max_steps 2 --warmup_steps 1 --batch_size 4 --dataset synthetic --eval_batches 2 "
            "--no-tensorboard")
PRECISION_OF_GPU = "bf16"  # what precision "auto" picks on a current GPU (course_lib.core.device)

FAKE_SRUN = r'''
"""srun, faked: run the command once per node of $SLURM_JOB_NODELIST (one task per node), side by side."""
import json, os, signal, subprocess, sys, threading
from course_lib.cluster.slurm import expand_nodelist

argv, options = sys.argv[1:], {}
while argv and argv[0].startswith("-"):
    key, sep, value = argv.pop(0).partition("=")
    if not sep and key in ("--output", "-o", "--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node"):
        value = argv.pop(0)
    options[key] = value if (sep or value) else True
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps({"tool": "srun", "options": options, "command": argv}) + "\n")
if os.environ.get("FAKE_SRUN_DRY_RUN") == "1":
    sys.exit(0)
hosts = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
procs, pumps = [], []
for node, host in enumerate(hosts):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0",
               SLURM_NTASKS=str(len(hosts)), SLURMD_NODENAME=host, SLURM_STEP_ID="0")
    pattern = options.get("--output") or options.get("-o")
    if pattern:
        path = pattern.replace("%n", str(node)).replace("%t", str(node)).replace("%N", host)
        out = open(path.replace("%j", os.environ["SLURM_JOB_ID"]), "w")
        procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
    else:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        prefix = f"{node}: " if "--label" in options or "-l" in options else ""
        def pump(stream=proc.stdout, prefix=prefix):
            for line in stream:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()
        pumps.append(threading.Thread(target=pump, daemon=True))
        pumps[-1].start()
        procs.append(proc)

def stop(*_):
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        proc.wait()
signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))
code = 0
while any(proc.poll() is None for proc in procs):
    failed = [proc.returncode for proc in procs if proc.returncode not in (None, 0)]
    if failed and options.get("--kill-on-bad-exit") == "1":
        stop()
    try:
        procs[[p.poll() is None for p in procs].index(True)].wait(timeout=0.2)
    except (subprocess.TimeoutExpired, ValueError):
        pass
for pump in pumps:
    pump.join(timeout=5)
sys.exit(next((proc.returncode for proc in procs if proc.returncode != 0), 0))
'''

FAKE_SCONTROL = r'''
"""scontrol, faked: `scontrol show hostnames <list>` expands a node list; anything else is only logged."""
import json, os, sys
from course_lib.cluster.slurm import expand_nodelist

args = sys.argv[1:]
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps({"tool": "scontrol", "args": args}) + "\n")
if args[:2] == ["show", "hostnames"]:
    hosts = expand_nodelist(args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"])
    sys.stdout.write("".join(host + "\n" for host in hosts))  # one write, as C stdio does: `| head -n 1` is safe
'''

FAKE_APPTAINER = r'''
"""apptainer, faked: `apptainer exec [options] IMAGE COMMAND...` runs COMMAND on this machine as if in the image.

The image's repository is $FAKE_IMAGE_REPO here, its runs/, logs/ and data/ links to the --bind sources (the
course_lib it runs is this machine's). --env sets variables, the image's repository path in them mapped, --pwd
the working folder; the image's Python environment (this one's) leads PATH, and the image has no Slurm, so srun,
scontrol and this script leave it.
"""
import json, os, sys
from pathlib import Path

IMAGE_REPO = "/home/course/course"
argv = sys.argv[1:]
assert argv.pop(0) == "exec", "only `apptainer exec` is faked"
options = {"--bind": [], "--env": [], "--pwd": None, "--nv": False}
while argv[0].startswith("-"):
    flag = argv.pop(0)
    if flag == "--nv":
        options[flag] = True
    elif flag in ("--bind", "--env"):
        options[flag] += argv.pop(0).split(",")
    elif flag == "--pwd":
        options[flag] = argv.pop(0)
    else:
        sys.exit(f"fake apptainer: {flag} is not faked")
image = argv.pop(0)
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps({"tool": "apptainer", "options": options, "image": image, "command": argv}) + "\n")
if not Path(image).is_file():
    sys.exit(f"FATAL: could not open image {image}: no such file")
repo = Path(os.environ["FAKE_IMAGE_REPO"])
repo.mkdir(parents=True, exist_ok=True)
inside = lambda path: path.replace(IMAGE_REPO, str(repo))
for bind in options["--bind"]:
    source, _, target = bind.partition(":")
    link = Path(inside(target or source))
    if not Path(source).is_dir():
        sys.exit(f"FATAL: bind source {source} does not exist")
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(source)
        except FileExistsError:  # the other node made it
            pass
env = dict(os.environ)
for item in options["--env"]:
    name, _, value = item.partition("=")
    env[name] = inside(value)
fake_bin = str(Path(__file__).resolve().parent)
image_python = str(Path(sys.executable).parent)  # the image's /opt/venv/bin comes first on its PATH
env["PATH"] = os.pathsep.join([image_python] + [p for p in env["PATH"].split(os.pathsep) if p != fake_bin])
os.chdir(inside(options["--pwd"] or os.getcwd()))
os.execvpe(argv[0], argv, env)
'''


# ---------------------------------------------------------------------------------------------- SLURM


def sbatch_directives(path: Path) -> dict[str, str]:
    """{option: value} of the #SBATCH lines, read as sbatch reads them: only before the first command."""
    directives = {}
    for line in path.read_text(encoding="utf-8").splitlines()[1:]:
        if line.startswith("#SBATCH"):
            option = line[len("#SBATCH"):].split("#")[0].strip()
            key, _, value = option.lstrip("-").partition("=")
            directives[key] = value or "true"
        elif line.strip() and not line.startswith("#"):
            break
    return directives


def cluster_world_size() -> int:
    """Ranks of the course's two-node job: nodes x GPUs per node of slurm_multinode.sbatch."""
    directives = sbatch_directives(SBATCH_FILES["multinode"])
    return int(directives["nodes"]) * int(directives["gpus-per-node"])


def job_id_with_free_port() -> int:
    """A job id whose rendezvous port (29500 + id % 1000, the sbatch files' rule) is free on this machine."""
    for _ in range(200):
        job_id = random.randrange(10_000, 1_000_000)
        with socket.socket() as s:
            try:
                s.bind(("", 29500 + job_id % 1000))
                return job_id
            except OSError:
                continue
    raise RuntimeError("no free port in 29500..30499")


def fake_slurm(tmp_path: Path, sbatch: Path, nnodes: int, nproc_per_node: int, train_args: str,
               dry_run: bool = False) -> dict:
    """The environment of `bash <sbatch>` as if SLURM ran it: SLURM_* variables and the fakes first on PATH."""
    fake_bin = tmp_path / "fake_bin"
    fake_bin.mkdir(exist_ok=True)
    for name, source in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("apptainer", FAKE_APPTAINER)):
        (fake_bin / name).write_text(f"#!{sys.executable}\n{source}")
        (fake_bin / name).chmod(0o755)
    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").exists():  # not a venv (e.g. conda): an activate that only sets PATH
        venv = tmp_path / "venv"
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        (venv / "bin" / "activate").write_text(f'export PATH="{BIN}:$PATH"\n')
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "course.sif").write_bytes(b"")  # slurm_apptainer.sbatch's default IMAGE (FAKE_APPTAINER runs it)
    environ = clean_environ(
        PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", VENV=str(venv),
        SLURM_JOB_ID=str(job_id_with_free_port()), SLURM_JOB_NAME=sbatch_directives(sbatch)["job-name"],
        SLURM_JOB_NODELIST="127.0.0.1" if nnodes == 1 else f"127.0.0.[1-{nnodes}]", SLURM_NNODES=str(nnodes),
        SLURM_NTASKS=str(nnodes), SLURM_NTASKS_PER_NODE="1", SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_CPUS_PER_TASK=str(max(1, (os.cpu_count() or 2) // nnodes)), NPROC_PER_NODE=str(nproc_per_node),
        TRAIN_ARGS=train_args, FAKE_SLURM_LOG=str(tmp_path / "slurm_calls.jsonl"),
        FAKE_SRUN_DRY_RUN="1" if dry_run else "0", FAKE_IMAGE_REPO=str(tmp_path / "image_repo"))
    for name in ("SCRATCH", "COURSE_OUTPUT_ROOT"):  # outputs in the submit folder, unless a test sets them
        environ.pop(name, None)
    return environ


def srun_calls(tmp_path: Path, tool: str = "srun") -> list[dict]:
    lines = (tmp_path / "slurm_calls.jsonl").read_text().splitlines()
    return [call for call in map(json.loads, lines) if call["tool"] == tool]


def split_apptainer(command: list[str]) -> tuple[dict, str, list[str]]:
    """`apptainer exec [options] IMAGE COMMAND...` -> ({option: [values]}, IMAGE, COMMAND)."""
    assert command[:2] == ["apptainer", "exec"], command
    rest, options = command[2:], {}
    while rest[0].startswith("-"):
        flag = rest.pop(0)
        options.setdefault(flag, []).append(True if flag in ("--nv", "--cleanenv", "-e") else rest.pop(0))
    return options, rest[0], rest[1:]


def unwrap_launch(command: list[str]) -> list[str]:
    """The torchrun command that srun starts, inside its SIGUSR1 wrapper (and apptainer exec)."""
    if command[:2] == ["apptainer", "exec"]:
        command = split_apptainer(command)[2]
    assert command[:len(USR1_WRAPPER)] == USR1_WRAPPER, f"start torchrun with SIGUSR1 ignored: {command[:6]}"
    return command[len(USR1_WRAPPER):]


def parse_launch(command: list[str]):
    """(torchrun's arguments, the TrainConfig of the training flags), each from the real parser."""
    if Path(command[0]).name != "torchrun":
        command = unwrap_launch(command)
    assert Path(command[0]).name == "torchrun", command
    launch = torchrun_parser().parse_args(command[1:])
    assert launch.module and launch.training_script == "course_lib.train", command
    train_args = course_train.build_parser().parse_args(launch.training_script_args)
    return launch, course_train.config_from_args(train_args)  # raises on an invalid value


def test_the_layout_override_and_the_pytorchjobs_tp_x_pp_line_are_valid_layouts_of_the_same_job(tmp_path):
    """LAYOUT="--tp 4 --pp 2" sbatch ... and the PyTorchJob's TP x PP flags give the 8-rank layout tp4 x pp2."""
    sbatch = SBATCH_FILES["multinode"]
    env = fake_slurm(tmp_path, sbatch, nnodes=2, nproc_per_node=4, train_args="--model_size small", dry_run=True)
    env["LAYOUT"] = "--tp 4 --pp 2"
    done = subprocess.run(["bash", sbatch], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (call,) = srun_calls(tmp_path)
    launch, cfg = parse_launch(call["command"])
    world_size = int(launch.nnodes) * int(launch.nproc_per_node)
    assert cfg.layout(world_size).name() == "tp4 pp2 1f1b m2" and cfg.resume == "auto"
    text = (CONFIG / "k8s_pytorchjob.yaml").read_text(encoding="utf-8")
    assert "--tp=4 --pp=2" in text and "TP x PP instead: --tp=4 and --pp=2" in text
    train_args = course_train.build_parser().parse_args(["--tp=4", "--pp=2", "--resume=auto"])
    assert course_train.config_from_args(train_args).layout(8).name() == "tp4 pp2 1f1b m2"


def test_sbatch_directives_ask_for_one_agent_per_node():
    for name, path in SBATCH_FILES.items():
        directives = sbatch_directives(path)
        text = path.read_text(encoding="utf-8")
        assert directives["ntasks-per-node"] == "1", name  # torchrun, not SLURM, starts the per-GPU processes
        # the time-limit warning to the steps' processes (not B:, the batch shell), and the job may be requeued
        assert directives["signal"] == "USR1@120" and directives["requeue"] == "true", name
        assert int(directives["gpus-per-node"]) >= 1 and int(directives["nodes"]) >= 1, name
        assert re.fullmatch(r"\d+:\d\d:\d\d", directives["time"]), name
        assert "%j" in directives["output"] and "partition" not in directives, name  # ##SBATCH stays a comment
        assert "set -euo pipefail" in text and "trap cleanup EXIT" in text, name
        subprocess.run(["bash", "-n", path], check=True)  # syntax
    assert cluster_world_size() == 8


@pytest.mark.parametrize("name", sorted(SBATCH_FILES))
def test_sbatch_default_launch_line_agrees_with_torchrun_and_the_training_cli(tmp_path, name):
    """Dry run with the file's own TRAIN_ARGS and node count: every flag must be one torchrun and course_lib.train
    accept, and the worker count must come from the GPUs SLURM reports."""
    directives = sbatch_directives(SBATCH_FILES[name])
    nnodes, gpus = int(directives["nodes"]), int(directives["gpus-per-node"])
    env = fake_slurm(tmp_path, SBATCH_FILES[name], nnodes=nnodes, nproc_per_node=0, train_args="", dry_run=True)
    del env["TRAIN_ARGS"], env["NPROC_PER_NODE"]  # the file's defaults ...
    env["SLURM_GPUS_ON_NODE"] = str(gpus)  # ... and what SLURM sets for --gpus-per-node
    done = subprocess.run(["bash", SBATCH_FILES[name]], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (call,) = srun_calls(tmp_path)
    assert call["options"]["--kill-on-bad-exit"] == "1" and call["options"]["--ntasks-per-node"] == "1"
    # Slurm >= 22.05: srun does not inherit --cpus-per-task from sbatch; without it the step gets one CPU.
    assert call["options"].get("--cpus-per-task") == env["SLURM_CPUS_PER_TASK"], call["options"]
    launch, cfg = parse_launch(call["command"])
    torch_env = slurm_to_torch_env(dict(env, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"))
    assert launch.nnodes == str(nnodes) and launch.nproc_per_node == str(gpus)
    assert launch.rdzv_backend == "c10d" and launch.rdzv_id == env["SLURM_JOB_ID"]
    assert launch.rdzv_endpoint == f"{torch_env['MASTER_ADDR']}:{torch_env['MASTER_PORT']}"  # course_lib.cluster.slurm's rule
    assert cfg.strategy == "ddp" and cfg.device == "auto" and cfg.precision == "auto"  # bf16 on GPUs, fp32 on CPUs
    assert cfg.out_dir.startswith("runs/") and cfg.log_dir.startswith("logs/") and cfg.resume == "auto"
    if name != "multinode":
        return
    call_env_job_id, job_name = env["SLURM_JOB_ID"], env["SLURM_JOB_NAME"]
    for other in ("apptainer",):  # the container runs the two-node job exactly as slurm_multinode.sbatch does
        (tmp_path / other).mkdir()
        env = fake_slurm(tmp_path / other, SBATCH_FILES[other], nnodes=nnodes, nproc_per_node=0, train_args="",
                         dry_run=True)
        del env["TRAIN_ARGS"], env["NPROC_PER_NODE"]
        env.update(SLURM_GPUS_ON_NODE=str(gpus), SLURM_JOB_ID=call_env_job_id)
        done = subprocess.run(["bash", SBATCH_FILES[other]], env=env, cwd=tmp_path / other, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        (other_call,) = srun_calls(tmp_path / other)
        same_name = [arg.replace(env["SLURM_JOB_NAME"], job_name) for arg in unwrap_launch(other_call["command"])]
        assert same_name == unwrap_launch(call["command"]), other
    if name == "multinode":
        assert cfg.resume == "auto" and launch.max_restarts >= 1 and cfg.ckpt_interval <= cfg.max_steps // 10
        assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in SBATCH_FILES[name].read_text()


def dry_run(tmp_path: Path, name: str, **environ) -> tuple[dict, dict]:
    """(the environment, srun's call) of the sbatch file run with srun faked (not starting anything)."""
    directives = sbatch_directives(SBATCH_FILES[name])
    env = fake_slurm(tmp_path, SBATCH_FILES[name], nnodes=int(directives["nodes"]), nproc_per_node=4, train_args="",
                     dry_run=True)
    env.update(environ)
    done = subprocess.run(["bash", SBATCH_FILES[name]], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (call,) = srun_calls(tmp_path)
    return env, call


@pytest.mark.parametrize("name", sorted(SBATCH_FILES))
def test_sbatch_starts_torchrun_with_sigusr1_ignored_and_writes_under_the_output_root(tmp_path, name):
    """Slurm's warning (SIGUSR1) must not kill torchrun's agent: the wrapper srun starts makes torchrun, and every
    process it starts, ignore the signal until a worker installs its own handler."""
    text = SBATCH_FILES[name].read_text(encoding="utf-8")
    assert "bash -c 'trap \"\" USR1; exec \"$@\"' torchrun-ignoring-usr1 \\\n    torchrun \\\n" in text
    assert "export COURSE_OUTPUT_ROOT=${COURSE_OUTPUT_ROOT:-${SCRATCH:-$SLURM_SUBMIT_DIR}}" in text
    subprocess.run(["bash", "-n", SBATCH_FILES[name]], check=True)  # syntax
    env, call = dry_run(tmp_path, name)
    command = call["command"] if name != "apptainer" else split_apptainer(call["command"])[2]
    wrapper = command[:len(USR1_WRAPPER)]
    assert wrapper == USR1_WRAPPER
    # The wrapper as srun receives it, around a program that reports what SIGUSR1 does in it and in its child.
    ignored = "import signal; print(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN, flush=True)"
    report = f"{ignored}; import subprocess, sys; subprocess.run([sys.executable, '-S', '-c', {ignored!r}])"
    done = subprocess.run([*wrapper, sys.executable, "-S", "-c", report], capture_output=True, text=True,
                          timeout=30, check=True)
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr
    # Relative outputs land under the output root: the scratch file system when the cluster names one
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "slurm_calls.jsonl").unlink()
    env, call = dry_run(tmp_path, name, SCRATCH=str(scratch))
    output = call["options"].get("--output")
    if output:  # the nodes' own files, beside the ranks' logs
        assert output.startswith(f"{scratch}/logs/"), output


def test_apptainer_job_binds_runs_logs_and_data_into_the_read_only_image(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env, call = dry_run(tmp_path, "apptainer", SCRATCH=str(scratch))
    options, image, inner = split_apptainer(call["command"])
    assert image == str(tmp_path / "course.sif")  # IMAGE's default: course.sif in the submit folder
    assert options["--nv"] == [True], "--nv: the host's driver and GPUs in the container"
    assert not {"--cleanenv", "-e", "--containall", "-C", "--writable"} & set(options), (
        "the host environment (NCCL_*, SLURM_*, MASTER_*) must reach the container, and the image stays read-only")
    assert options["--pwd"] == [IMAGE_REPO]
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert f"WORKDIR {IMAGE_REPO}" in dockerfile, "the image's repository is where the job binds its folders"
    (binds,) = options["--bind"]
    pairs = dict(bind.split(":") for bind in binds.split(","))
    assert pairs == {str(scratch / folder): f"{IMAGE_REPO}/{folder}" for folder in ("runs", "logs", "data")}
    assert all(Path(source).is_dir() for source in pairs)  # created before the container starts
    (container_env,) = options["--env"]
    values = dict(item.split("=", 1) for item in container_env.split(","))
    assert values["COURSE_OUTPUT_ROOT"] == IMAGE_REPO  # inside, the bound folders are the repository's
    threads = int(env["SLURM_CPUS_PER_TASK"]) // int(env["NPROC_PER_NODE"])
    assert values["OMP_NUM_THREADS"] == str(max(1, threads)) and values["NCCL_DEBUG"] == "WARN"
    launch, cfg = parse_launch(inner)
    assert cfg.resume == "auto" and not Path(cfg.out_dir).is_absolute() and not Path(cfg.log_dir).is_absolute()
    assert call["options"]["--output"].startswith(f"{scratch}/logs/{env['SLURM_JOB_NAME']}/")
    # Without an image, the job stops at once and says so
    env["IMAGE"] = str(tmp_path / "missing.sif")
    done = subprocess.run(["bash", SBATCH_FILES["apptainer"]], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "no Apptainer image at" in done.stderr


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped-by-the-warning", "finished"])
def test_apptainer_job_requeues_from_the_host_when_the_image_cannot(tmp_path, monkeypatch, stopped):
    """Inside the image there is no scontrol: the training CLI's own requeue fails and says so in its output, and
    the batch script, on the host, requeues the job instead."""
    job_id = "4242"
    monkeypatch.setenv("SLURM_JOB_ID", job_id)
    monkeypatch.setenv("PATH", str(tmp_path / "no_slurm_here"))
    said = course_train.requeue_slurm_job()  # what rank 0 prints after the warning, in the container
    assert "failed" in said
    monkeypatch.undo()
    directives = sbatch_directives(SBATCH_FILES["apptainer"])
    env = fake_slurm(tmp_path, SBATCH_FILES["apptainer"], nnodes=int(directives["nodes"]), nproc_per_node=4,
                     train_args="", dry_run=True)
    env["SLURM_JOB_ID"] = job_id
    node_logs = tmp_path / "logs" / env["SLURM_JOB_NAME"]
    node_logs.mkdir(parents=True)
    last = f"stopped by SIGUSR1 after step 120 of 5000; {said}; continue with --resume" if stopped else "done"
    (node_logs / f"node1-{job_id}.out").write_text(f"step 120\n{last}\n")
    done = subprocess.run(["bash", SBATCH_FILES["apptainer"]], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    requeues = [call for call in map(json.loads, (tmp_path / "slurm_calls.jsonl").read_text().splitlines())
                if call["tool"] == "scontrol" and call["args"][:1] == ["requeue"]]
    assert requeues == ([{"tool": "scontrol", "args": ["requeue", job_id]}] if stopped else [])


def check_trained(tmp_path: Path, run_name: str, world_size: int, steps: int, output: str) -> None:
    records = [json.loads(line) for line in (tmp_path / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses), records
    assert any(r["kind"] == "eval" for r in records)
    for rank in range(world_size):
        log = (tmp_path / "logs" / run_name / f"rank_{rank}" / "train.log").read_text()
        assert f"[rank {rank}/{world_size}]" in log
    assert f"x {world_size} ranks: steps 0 -> {steps}" in output, output


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_example_runs_with_faked_slurm(tmp_path):
    """One node, two CPU workers: the file's launch line, unchanged, trains and reports its exit."""
    sbatch = SBATCH_FILES["example"]
    env = fake_slurm(tmp_path, sbatch, nnodes=1, nproc_per_node=2, train_args=TINY_RUN)
    [(code, output)] = run_process_tree([["bash", sbatch]], env=env, cwd=tmp_path)
    assert code == 0, output
    job_id, port = env["SLURM_JOB_ID"], 29500 + int(env["SLURM_JOB_ID"]) % 1000
    assert f"job {job_id} on 127.0.0.1: 1 node(s) x 2 workers, rendezvous at 127.0.0.1:{port}" in output
    assert f"job {job_id} ended with exit code 0" in output
    check_trained(tmp_path, f"course-ddp-{job_id}", world_size=2, steps=2, output=output)
    assert "0: " in output  # srun --label: each line says which node printed it


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_multinode_runs_with_faked_slurm(tmp_path):
    """Two simulated nodes, one worker each: two torchrun agents meet at the c10d rendezvous of node 0."""
    sbatch = SBATCH_FILES["multinode"]
    env = fake_slurm(tmp_path, sbatch, nnodes=2, nproc_per_node=1, train_args=TINY_RUN)
    [(code, output)] = run_process_tree([["bash", sbatch]], env=env, cwd=tmp_path)
    job_id, run_name = env["SLURM_JOB_ID"], env["SLURM_JOB_NAME"]
    nodes = [(tmp_path / "logs" / run_name / f"node{n}-{job_id}.out").read_text() for n in range(2)]
    assert code == 0, output + "".join(nodes)
    assert f"job {job_id} on 127.0.0.[1-2]: 2 node(s) x 1 workers" in output
    assert f"job {job_id} ended with exit code 0" in output
    check_trained(tmp_path, run_name, world_size=2, steps=2, output="".join(nodes))


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_job_reports_a_failed_training_run(tmp_path):
    """An invalid training flag: the workers fail, srun fails, the job fails, and the trap says so."""
    sbatch = SBATCH_FILES["example"]
    env = fake_slurm(tmp_path, sbatch, nnodes=1, nproc_per_node=1, train_args=TINY_RUN + " --max_steps 0")
    [(code, output)] = run_process_tree([["bash", sbatch]], env=env, cwd=tmp_path)
    assert code != 0 and f"ended with exit code {code}" in output, output
    assert "TrainConfig.max_steps must be a positive integer" in output
    assert not (tmp_path / "runs" / f"course-ddp-{env['SLURM_JOB_ID']}" / "metrics.jsonl").exists()


def signal_the_steps(tag: str, signum: int) -> int:
    """What Slurm's --signal does: the signal to every process of the job steps (what srun started), not to the
    batch script or srun. Returns how many processes got it."""
    sruns = [p for p in psutil.process_iter(["cmdline", "environ"])
             if (p.info["environ"] or {}).get("COURSE_TEST_TAG") == tag
             and any(Path(arg).name == "srun" for arg in (p.info["cmdline"] or [])[:2])]
    signalled = 0
    for srun in sruns:
        for proc in srun.children(recursive=True):
            try:
                proc.send_signal(signum)
                signalled += 1
            except psutil.NoSuchProcess:
                pass
    return signalled


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["apptainer"])  # the longest path; slurm_multinode.sbatch runs the same line
def test_time_limit_warning_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path, name):
    """SIGUSR1 to the steps' processes, as `#SBATCH --signal=USR1@120` sends it: torchrun survives (the wrapper),
    every rank stops after its step with one checkpoint, the job is requeued (by the CLI, or from the host where
    the image has no Slurm) and ends with exit code 0; run again, as the requeued job, it continues there. The
    Apptainer job runs one container per node and writes only to the scratch folder it binds."""
    sbatch = SBATCH_FILES[name]
    env = fake_slurm(tmp_path, sbatch, nnodes=2, nproc_per_node=1, train_args=TINY_RUN + " --max_steps 100000")
    job_id, run_name = env["SLURM_JOB_ID"], env["SLURM_JOB_NAME"]
    tag = uuid.uuid4().hex
    env.update(COURSE_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    root = tmp_path / "scratch" if name == "apptainer" else tmp_path  # where runs/ and logs/ land
    if name == "apptainer":
        env["SCRATCH"] = str(root)
    metrics = root / "runs" / run_name / "metrics.jsonl"
    with open(tmp_path / "job.out", "w+") as log:
        job = subprocess.Popen(["bash", sbatch], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
                assert job.poll() is None and time.monotonic() < deadline, "the run did not start training"
                time.sleep(0.2)
            assert signal_the_steps(tag, signal.SIGUSR1) >= 4  # 2 torchrun agents, 2 workers
            code = job.wait(timeout=240)
        finally:
            kill_process_trees([job], tag)
        log.seek(0)
        output = log.read()
    nodes = "".join(p.read_text() for p in (root / "logs" / run_name).glob(f"node*-{job_id}.out"))
    assert code == 0, output + nodes
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+) of 100000", nodes)
    assert stopped, output + nodes
    step = int(stopped.group(1))
    requeues = [call for call in map(json.loads, (tmp_path / "slurm_calls.jsonl").read_text().splitlines())
                if call["tool"] == "scontrol" and call["args"][:1] == ["requeue"]]
    assert requeues == [{"tool": "scontrol", "args": ["requeue", job_id]}], requeues  # once, by the CLI or the host
    if name == "apptainer":
        assert f"scontrol requeue {job_id} failed" in nodes and "requeueing job" in output
        (call, _) = srun_calls(tmp_path, "apptainer")  # one container per node
        assert call["options"]["--nv"] and call["options"]["--pwd"] == IMAGE_REPO
        assert not (tmp_path / "runs").exists()  # nothing written beside the image
    # The requeued job: the same script, job id and run folder; --resume auto continues after the checkpoint
    (tmp_path / "slurm_calls.jsonl").unlink()
    env["TRAIN_ARGS"] = TINY_RUN + f" --max_steps {step + 2}"
    [(code, output)] = run_process_tree([["bash", sbatch]], env=env, cwd=tmp_path)
    nodes = "".join(p.read_text() for p in (root / "logs" / run_name).glob(f"node*-{job_id}.out"))
    assert code == 0 and f"x 2 ranks: steps {step} -> {step + 2}" in nodes, output + nodes


@pytest.mark.slow
@pytest.mark.distributed
def test_capstone_job_stops_the_learners_script_at_the_time_limit_requeues_and_resumes(tmp_path):
    """config/capstone.sbatch with a learner's script (tests/capstone/toy_train.py): SIGTERM to the batch script, as
    `#SBATCH --signal=B:TERM@120` sends it, reaches every worker once through srun and torchrun; they checkpoint and
    exit, the job requeues itself and ends with 0; the requeued job starts the script with --resume and continues
    after the checkpoint's step."""
    sbatch = CONFIG / "capstone.sbatch"
    env = fake_slurm(tmp_path, sbatch, nnodes=1, nproc_per_node=2, train_args="")
    job_id = env["SLURM_JOB_ID"]
    shutil.copy(ROOT / "tests" / "capstone" / "toy_train.py", tmp_path / "my_train.py")
    common = "--batch_size 4 --out_dir runs/mine --log_dir logs/mine"
    tag = uuid.uuid4().hex
    env.update(SCRIPT="my_train.py", SCRIPT_ARGS=f"--max_steps 1000000 {common}", PYTHONUNBUFFERED="1",
               COURSE_TEST_TAG=tag)
    rank_log = tmp_path / "logs" / "mine" / "rank_0.log"
    with open(tmp_path / "job.out", "w+") as log:
        job = subprocess.Popen(["bash", sbatch], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not (rank_log.exists() and "step" in rank_log.read_text()):
                assert job.poll() is None and time.monotonic() < deadline, "the script did not start training"
                time.sleep(0.2)
            job.send_signal(signal.SIGTERM)  # to the batch script only (B:)
            code = job.wait(timeout=120)
        finally:
            kill_process_trees([job], tag)
        log.seek(0)
        output = log.read()
    assert code == 0, output
    saved = torch.load(tmp_path / "runs" / "mine" / "checkpoint.pt", weights_only=True)["step"]
    last = rank_log.read_text().splitlines()
    assert last[-1] == f"stopped by SIGTERM after step {saved}", last[-3:]
    calls = [json.loads(line) for line in (tmp_path / "slurm_calls.jsonl").read_text().splitlines()]
    assert [c["args"] for c in calls if c["tool"] == "scontrol" and c["args"][0] == "requeue"] == [["requeue", job_id]]
    # the requeued job: SLURM_RESTART_COUNT=1, the same script and arguments plus --resume
    env.update(SLURM_RESTART_COUNT="1", SCRIPT_ARGS=f"--max_steps {saved + 2} {common}")
    [(code, output)] = run_process_tree([["bash", sbatch]], env=env, cwd=tmp_path)
    assert code == 0 and "--resume" in output, output
    new = rank_log.read_text().splitlines()[len(last):]
    assert [line.split(" loss ")[0].split("step ")[1] for line in new] == [str(saved + 1), str(saved + 2)], new


def real_slurm_missing() -> str | None:
    if os.environ.get("COURSE_REAL_SLURM") != "1":
        return "opt-in: set COURSE_REAL_SLURM=1 (and start Slurm: bash scripts/local_slurm.sh start)"
    if not shutil.which("sbatch"):
        return "sbatch is not installed (apt-get install slurm-wlm)"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return None if "UP" in ping.stdout else "no Slurm controller answers `scontrol ping`"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(real_slurm_missing() is not None, reason=str(real_slurm_missing()))
@pytest.mark.parametrize("name", NATIVE_SBATCH)
def test_real_slurm_runs_the_sbatch_files(tmp_path, name):
    """sbatch --wait on a real (one-node, GPU-less) Slurm; the command line asks for CPUs instead of GPUs."""
    (tmp_path / "logs").mkdir()
    env = clean_environ(TRAIN_ARGS=TINY_RUN, NPROC_PER_NODE="2", VENV=sys.prefix)
    command = ["sbatch", "--wait", "--parsable", "--nodes=1", "--gpus-per-node=0",
               f"--cpus-per-task={os.cpu_count() or 2}", "--time=00:10:00", "--export=ALL", SBATCH_FILES[name]]
    sbatch = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    job_id = sbatch.stdout.readline().strip().split(";")[0]  # printed at submission; --wait then blocks
    try:
        stdout, stderr = sbatch.communicate(timeout=600)
    finally:
        if sbatch.poll() is None:
            subprocess.run(["scancel", job_id])
            sbatch.kill()
    done = subprocess.CompletedProcess(command, sbatch.returncode, stdout, stderr)
    job_name = sbatch_directives(SBATCH_FILES[name])["job-name"]
    output = (tmp_path / "logs" / f"{job_name}-{job_id}.out").read_text()
    run_name = job_name if name == "multinode" else f"{job_name}-{job_id}"
    nodes = "".join(p.read_text() for p in (tmp_path / "logs" / run_name).glob("node*.out"))
    assert done.returncode == 0, done.stderr + output + nodes
    assert f"job {job_id} ended with exit code 0" in output
    check_trained(tmp_path, run_name, world_size=2, steps=2, output=output + nodes)


# ------------------------------------------------------------------------------------------ Kubernetes


def test_kubernetes_pytorchjob_is_coherent_with_torchrun_and_the_training_cli():
    pvc, job = yaml.safe_load_all((CONFIG / "k8s_pytorchjob.yaml").read_text(encoding="utf-8"))
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    pods = sum(spec["replicas"] for spec in replicas.values())
    assert job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == pods  # gang: all pods or none
    for role, spec in replicas.items():
        pod = spec["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        launch, cfg = parse_launch(container["command"] + [
            arg.replace("$(MASTER_ADDR)", "course-ddp-master-0").replace("$(MASTER_PORT)", "23456")
            for arg in container["args"]])
        assert int(launch.nnodes) == pods and int(launch.nproc_per_node) == gpus == int(job["spec"]["nprocPerNode"])
        assert pods * gpus == cluster_world_size(), role  # the same 8-rank job as slurm_multinode.sbatch
        assert launch.rdzv_backend == "c10d" and launch.rdzv_endpoint == "course-ddp-master-0:23456"
        assert cfg.strategy == "ddp" and cfg.resume == "auto"
        env = {item["name"]: item.get("value") for item in container["env"]}
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and launch.max_restarts >= 1
        assert int(env["OMP_NUM_THREADS"]) * gpus <= int(container["resources"]["limits"]["cpu"])
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert cfg.out_dir.startswith(mounts["checkpoints"] + "/")  # checkpoints land on the shared volume
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]  # every pod runs the same program


# ------------------------------------------------------------------------------------------- DeepSpeed


@pytest.fixture(scope="module")
def deepspeed():
    return pytest.importorskip("deepspeed", reason=DEEPSPEED_MISSING)


def deepspeed_view(deepspeed, path: Path, world_size: int, monkeypatch):
    """DeepSpeed's own reading of a config file, as rank 0 of a `world_size`-rank data-parallel job."""
    from deepspeed.runtime import config as ds_config

    class DataParallelWorld:  # the "model parallel unit" DeepSpeedConfig asks for the data-parallel size
        def get_data_parallel_world_size(self):
            return world_size

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)  # no process group needed
    return ds_config.DeepSpeedConfig(json.loads(path.read_text(encoding="utf-8")), mpu=DataParallelWorld())


def known_deepspeed_keys(deepspeed) -> set[str]:
    from deepspeed.runtime import constants
    from deepspeed.runtime.swap_tensor import constants as aio
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    return {value for name, value in vars(constants).items() if name.isupper() and isinstance(value, str)} | {
        ZERO_OPTIMIZATION, aio.AIO}


@pytest.mark.parametrize("path", DEEPSPEED_FILES, ids=lambda p: p.stem)
def test_deepspeed_config_loads_in_deepspeeds_parser(deepspeed, monkeypatch, path):
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert set(raw) <= known_deepspeed_keys(deepspeed)  # DeepSpeed silently ignores a misspelt top-level key
    world = cluster_world_size()
    view = deepspeed_view(deepspeed, path, world, monkeypatch)
    assert view.train_batch_size == view.train_micro_batch_size_per_gpu * view.gradient_accumulation_steps * world
    assert view.zero_optimization_stage == int(re.search(r"zero(\d)", path.stem).group(1))
    offload = "nvme" if "nvme" in path.stem else "cpu" if "offload" in path.stem else None
    for part in (view.zero_config.offload_optimizer, view.zero_config.offload_param):
        assert (part.device if part else None) == offload
    if offload == "nvme":
        from deepspeed.runtime.swap_tensor import constants as aio
        assert set(raw["aio"]) <= {v for k, v in vars(aio).items() if k.startswith("AIO_") and isinstance(v, str)}
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):  # DeepSpeed checks the arithmetic
        deepspeed_view(deepspeed, path, world // 4, monkeypatch)


@pytest.mark.parametrize("path", DEEPSPEED_FILES, ids=lambda p: p.stem)
def test_deepspeed_config_teaches_the_courses_training_recipe(path):
    """Optimizer, clipping, batch, schedule length and precision are course_lib.train's defaults."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    defaults = course_train.TrainConfig()
    optimizer_defaults = inspect.signature(configure_optimizer).parameters
    assert raw["optimizer"]["type"] == "AdamW"
    params = raw["optimizer"]["params"]
    assert params["lr"] == defaults.lr and params["weight_decay"] == defaults.weight_decay
    assert tuple(params["betas"]) == optimizer_defaults["betas"].default
    assert params["eps"] == optimizer_defaults["eps"].default
    assert raw["gradient_clipping"] == defaults.grad_clip
    assert raw["train_micro_batch_size_per_gpu"] == defaults.batch_size
    assert raw["gradient_accumulation_steps"] == defaults.grad_accum_steps
    schedule = raw["scheduler"]["params"]
    assert raw["scheduler"]["type"] == "WarmupCosineLR" and schedule["warmup_type"] == "linear"
    assert schedule["total_num_steps"] == defaults.max_steps and schedule["warmup_num_steps"] == defaults.warmup_steps
    assert math.isclose(schedule["cos_min_ratio"] * defaults.lr, defaults.min_lr)
    assert raw["bf16"]["enabled"] is (PRECISION_OF_GPU == "bf16") and not raw.get("fp16", {}).get("enabled")


def test_deepspeed_schedule_equals_the_courses_after_warmup(deepspeed):
    """DeepSpeed's WarmupCosineLR, built from the config, against course_lib.core.optim.get_lr, update by update.

    DeepSpeed's first update uses lr 0 and its warmup reaches lr * (s - 1) / warmup at update s, two updates
    behind the course's lr * (s + 1) / warmup; from the first update after warmup on, both follow one cosine.
    """
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    raw = json.loads((CONFIG / "deepspeed_zero2.json").read_text(encoding="utf-8"))
    lr, schedule = raw["optimizer"]["params"]["lr"], raw["scheduler"]["params"]
    total, warmup = schedule["total_num_steps"], schedule["warmup_num_steps"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = WarmupCosineLR(optimizer, **schedule)
    deepspeed_lrs = []
    for _ in range(total):  # what each update uses, then the step DeepSpeed's engine takes after it
        deepspeed_lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    course = dict(max_lr=lr, min_lr=lr * schedule["cos_min_ratio"], warmup_steps=warmup, max_steps=total)
    course_lrs = [get_lr(step, **course) for step in range(total)]
    torch.testing.assert_close(torch.tensor(deepspeed_lrs[warmup + 1:], dtype=torch.float64),
                               torch.tensor(course_lrs[warmup + 1:], dtype=torch.float64))
    torch.testing.assert_close(torch.tensor(deepspeed_lrs[2:warmup + 1], dtype=torch.float64),
                               torch.tensor(course_lrs[:warmup - 1], dtype=torch.float64))
    assert deepspeed_lrs[0] == 0.0 and course_lrs[0] == lr / warmup


def test_training_flags_override_the_deepspeed_file():
    raw = json.loads((CONFIG / "deepspeed_zero3_offload.json").read_text(encoding="utf-8"))
    cfg, ds, notes = resolve_configs(raw, {"batch_size": 4, "max_steps": 30, "lr": 1e-3}, world_size=2, on_gpu=False)
    assert (cfg.batch_size, cfg.max_steps, cfg.lr) == (4, 30, 1e-3)  # the flags win ...
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["optimizer"]["params"]["lr"] == 1e-3
    assert ds["scheduler"]["params"]["total_num_steps"] == 30 and cfg.warmup_steps == 3  # ... with a shorter warmup
    assert cfg.weight_decay == raw["optimizer"]["params"]["weight_decay"]  # the file fills the rest
    assert ds["train_batch_size"] == 4 * 1 * 2 and "train_batch_size 128" in notes[0]
    assert cfg.precision == "fp32" and not ds["bf16"]["enabled"]  # "auto" on a CPU, as everywhere in the course
    assert "torch_adam" not in ds["optimizer"]["params"]  # offloaded: DeepSpeed's CPU Adam does the step
    cfg, ds, notes = resolve_configs(raw, {}, world_size=cluster_world_size(), on_gpu=True)
    assert cfg.precision == "bf16" and ds["bf16"]["enabled"] and notes == []  # the file as written, on 8 GPUs
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        resolve_configs(raw, {"warmup_steps": 0}, world_size=1, on_gpu=False)


def test_training_cli_accepts_the_deepspeed_launchers_local_rank(tmp_path, monkeypatch):
    """`deepspeed --num_gpus N` runs `python -m <module> --local_rank=<n> ...`: the CLI copies it to LOCAL_RANK."""
    monkeypatch.setenv("LOCAL_RANK", "unset")
    monkeypatch.delenv("LOCAL_RANK")  # absent now, and absent again after the test
    monkeypatch.chdir(tmp_path)
    result = course_train.main(["--local_rank=0", "--strategy", "ddp", *TINY_RUN.split(), "--no-progress",
                                "--out_dir", "run", "--log_dir", "logs"])
    assert os.environ["LOCAL_RANK"] == "0" and result["world_size"] == 1 and result["final_step"] == 2
    args = course_train.build_parser().parse_args(["--local-rank", "3"])  # the spelling of newer launchers
    assert args.local_rank == 3


def read_losses(run_dir: Path) -> torch.Tensor:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return torch.tensor([r["loss"] for r in records if r["kind"] == "train"] +
                        [r["val_loss"] for r in records if r["kind"] == "eval"], dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_launcher_zero3_on_two_ranks_equals_zero2_on_one(deepspeed, tmp_path):
    """The real `deepspeed` launcher (which passes --local_rank in argv) and deepspeed.initialize on CPU/gloo.

    ZeRO-3 shards parameters, gradients and optimizer states over 2 ranks; with the same global batch it must
    take the same steps as ZeRO-2 on one rank.
    """
    common = [*TINY_RUN.replace("--batch_size 4", "").split(), "--max_steps", "3", "--no-progress"]
    [(code, out)] = run_process_tree([[sys.executable, "-m", "course_lib.integrations.deepspeed_train", "--deepspeed_config",
                                       CONFIG / "deepspeed_zero2.json", *common, "--batch_size", "8",
                                       "--out_dir", "one"]], cwd=tmp_path, timeout=600)
    assert code == 0 and "DeepSpeed ZeRO-2: 1 rank(s), fp32" in out, out
    port = job_id_with_free_port() % 1000 + 29500
    [(code, out)] = run_process_tree([[BIN / "deepspeed", "--num_gpus", "2", "--master_port", port, "--module",
                                       "course_lib.integrations.deepspeed_train", "--deepspeed_config",
                                       CONFIG / "deepspeed_zero3.json", *common, "--batch_size", "4",
                                       "--out_dir", "two"]], cwd=tmp_path, timeout=300)
    assert code == 0 and "DeepSpeed ZeRO-3: 2 rank(s), fp32" in out, out
    assert "--local_rank=1" in out  # the launcher's argv form reached the training CLI
    torch.testing.assert_close(read_losses(tmp_path / "two"), read_losses(tmp_path / "one"))
    shards = sorted(p.name for p in (tmp_path / "two" / "deepspeed" / "step3").glob("*optim_states.pt"))
    assert len(shards) == 2  # one optimizer shard per rank: a ranked checkpoint
    # The shards put together (DeepSpeed's zero_to_fp32) are the trained model: same validation loss.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg = course_train.TrainConfig(dataset="synthetic")
    model = GPT(course_train.build_model_config(cfg))
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "two" / "deepspeed"), tag="step3"))
    _, val_tokens = course_train.load_splits(cfg)
    val_loss = evaluate(model, val_tokens, batch_size=8, block_size=model.config.block_size, max_batches=2)
    torch.testing.assert_close(torch.tensor(val_loss, dtype=torch.float32), read_losses(tmp_path / "two")[-1])


# ------------------------------------------------------------------------------------------ Accelerate


@pytest.mark.parametrize("name", ["accelerate_multi_gpu.yaml", "accelerate_cpu.yaml"])
def test_accelerate_config_loads_and_is_coherent(name):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    from course_lib.integrations.accelerate_train import PRECISION_TO_ACCELERATE

    config = load_config_from_file(str(CONFIG / name))
    raw = yaml.safe_load((CONFIG / name).read_text(encoding="utf-8"))
    assert set(raw) <= set(vars(config))  # every key is one Accelerate knows
    # MULTI_GPU is what makes `accelerate launch` start num_processes processes (through torchrun); MULTI_CPU
    # or --cpu would start one.
    assert config.distributed_type == DistributedType.MULTI_GPU and config.num_processes >= 2
    assert config.num_processes % config.num_machines == 0 and 0 <= config.machine_rank < config.num_machines
    assert config.mixed_precision in PRECISION_TO_ACCELERATE.values()
    if name == "accelerate_cpu.yaml":
        assert config.use_cpu and config.mixed_precision == "no"  # the course's CPU precision is fp32
    else:
        assert not config.use_cpu and config.mixed_precision == PRECISION_OF_GPU
        gpus_per_node = int(sbatch_directives(SBATCH_FILES["example"])["gpus-per-node"])
        assert config.num_processes // config.num_machines == gpus_per_node


@pytest.mark.slow
@pytest.mark.distributed
def test_accelerate_cpu_config_starts_two_processes(tmp_path):
    [(code, out)] = run_process_tree([[BIN / "accelerate", "launch", "--config_file", CONFIG / "accelerate_cpu.yaml",
                                       "--main_process_port", str(free_port()),
                                       ROOT / "scripts" / "accelerate_train.py", *TINY_RUN.split(), "--no-progress",
                                       "--out_dir", "run"]], cwd=tmp_path)
    assert code == 0 and "Accelerate: 2 process(es) on cpu" in out, out
