"""The launcher: real ranks, results back in rank order, failures named and contained, no leftovers."""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from course_lib.runtime import demo_workers
from course_lib.runtime import launch as launch_module
from course_lib.runtime.launch import RankFailure, launch

pytestmark = pytest.mark.distributed


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it is gone if its state is Z and it has no process group members.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].split()[0] == "Z"


def _children_of(pid: int) -> list[int]:
    me = str(pid)
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def _children_of_this_process() -> list[int]:
    """The ranks still alive: this process's children and the fork server's (multiprocessing's helpers, the fork
    server and the resource tracker, are not ranks)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver._forkserver_pid
    kids = []
    for pid in _children_of(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if pid == server:
            kids += _children_of(pid)
        elif b"resource_tracker" not in cmdline:
            kids.append(pid)
    return kids


def test_results_in_rank_order_and_env(tmp_path):
    results = launch(demo_workers.whoami, world_size=3, log_dir=tmp_path, echo=False)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["world_size"] for r in results} == {3}
    assert {r["backend"] for r in results} == {"gloo"}
    assert len({r["pid"] for r in results}) == 3
    for r in results:
        assert r["env"]["RANK"] == str(r["rank"]) and r["env"]["LOCAL_RANK"] == str(r["rank"])
        assert r["env"]["WORLD_SIZE"] == "3" and r["env"]["LOCAL_WORLD_SIZE"] == "3"
    assert len({r["env"]["MASTER_PORT"] for r in results}) == 1
    for rank in range(3):
        assert (tmp_path / f"rank_{rank}" / "train.log").exists()
    assert _children_of_this_process() == []


def test_allreduce_and_rank_logs(tmp_path):
    results = launch(demo_workers.allreduce_demo, world_size=2, log_dir=tmp_path, echo=False)
    assert [r["after"] for r in results] == [3.0, 3.0]
    assert "after all_reduce: 3" in (tmp_path / "rank_1" / "train.log").read_text()


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failing_rank_stops_the_job_and_is_named(tmp_path, mode):
    marker = tmp_path / "failed_at"
    with pytest.raises(RankFailure) as info:
        launch(demo_workers.failing_worker, world_size=3, args=(2, mode), kwargs={"failed_at_file": str(marker)},
               log_dir=tmp_path, echo=False, timeout_s=30)
    raised_at = time.time()
    failure = info.value
    assert failure.rank == 2
    assert "rank 2" in str(failure)
    if mode == "raise":
        assert "ValueError: simulated failure in rank 2" in str(failure)
        assert "failing_worker" in failure.remote_traceback
    else:
        assert "SIGKILL" in str(failure)
    assert raised_at - float(marker.read_text()) < 5.0
    assert len(failure.pids) == 3 and all(_gone(pid) for pid in failure.pids)
    assert _children_of_this_process() == []


def test_skipped_collective_times_out_naming_the_missing_rank(tmp_path):
    start = time.time()
    with pytest.raises(RankFailure, match=r"rank\(s\) 1 did not arrive") as info:
        launch(demo_workers.failing_worker, world_size=3, args=(1, "skip"), log_dir=tmp_path, echo=False, timeout_s=4)
    assert info.value.rank == 1
    assert time.time() - start < 4 + 20  # the timeout plus start-up, never torch's 30-minute default
    assert _children_of_this_process() == []


def _line_of(function, text: str) -> int:
    """The line number of the first line of `function`'s source that contains `text`."""
    import inspect

    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_a_hang_names_where_each_rank_waits_and_the_line(tmp_path):
    collective_line = _line_of(demo_workers.failing_worker, "dist.all_reduce(value)")
    with pytest.raises(RankFailure) as info:
        launch(demo_workers.failing_worker, world_size=2, args=(1, "skip"), log_dir=tmp_path, echo=False, timeout_s=3)
    failure = info.value
    waiting = f"waited in all_reduce, called at course_lib/runtime/demo_workers.py:{collective_line} in failing_worker"
    assert failure.places[0].startswith(waiting), failure.places
    assert f"rank 0 {waiting}: dist.all_reduce(value)" in str(failure)
    assert "returned from the worker" in failure.places[1]
    assert "all_reduce" in failure.stacks[0]  # the waiting rank's own traceback


def test_a_rank_that_never_reaches_the_collective_is_shown_at_its_line(tmp_path):
    stall_line = _line_of(demo_workers.failing_worker, "time.sleep(0.05)")
    with pytest.raises(RankFailure, match=r"rank\(s\) 1 did not arrive while rank\(s\) 0 waited") as info:
        launch(demo_workers.failing_worker, world_size=2, args=(1, "stall"), log_dir=tmp_path, echo=False, timeout_s=3)
    failure = info.value
    assert failure.rank == 1
    assert failure.places[1] == (f"was still running, at course_lib/runtime/demo_workers.py:{stall_line} in "
                                 "failing_worker: time.sleep(0.05)")
    assert failure.places[0].startswith("waited in all_reduce, called at course_lib/runtime/demo_workers.py:")
    assert "in failing_worker" in failure.stacks[1] and "Thread 0x" not in failure.stacks[1].split("\n", 1)[1]
    assert _children_of_this_process() == []


def test_where_reads_frames_of_tracebacks_and_of_faulthandler_dumps():
    from course_lib.runtime.launch import frames_of_dump, where

    dump = (f'Thread 0x00007f01 (most recent call first):\n  File "{launch_module.__file__}", line 91 in watch\n\n'
            'Current thread 0x00007f02 (most recent call first):\n'
            '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 5349 in barrier\n'
            f'  File "{demo_workers.__file__}", line 3 in job\n'
            f'  File "{launch_module.__file__}", line 123 in _rank_main\n')
    frames = frames_of_dump(dump)
    assert [name for _, _, name in frames] == ["_rank_main", "job", "barrier"]
    assert where(frames).startswith("in barrier, called at course_lib/runtime/demo_workers.py:3 in job")
    assert where([(launch_module.__file__, 1, "_rank_main")]) == "(no frame of the worker's code on its stack)"


def rank_1_skips_step_1(rank, step):
    return "skip" if (rank, step) == (1, 1) else None


def test_a_fault_function_written_in_a_notebook_breaks_the_rank_it_names(tmp_path):
    from course_lib.runtime.spawn import spawnable

    assert launch(demo_workers.all_reduce_steps, world_size=2, args=(spawnable(no_fault),), kwargs={"steps": 3},
                  echo=False) == [6, 6]  # 3 steps of an all_reduce of ones over 2 ranks
    with pytest.raises(RankFailure, match=r"rank\(s\) 1 did not arrive") as info:
        launch(demo_workers.all_reduce_steps, world_size=2, args=(spawnable(rank_1_skips_step_1),),
               kwargs={"steps": 3}, log_dir=tmp_path, echo=False, timeout_s=4)
    assert info.value.rank == 1


def no_fault(rank, step):
    return None


def test_notebook_defined_worker_is_refused():
    def local_worker():
        return 1
    with pytest.raises(TypeError, match="cannot be sent"):
        launch(local_worker, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        launch(demo_workers.whoami, world_size=0)


def test_two_launches_at_once_do_not_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default log folder, logs/, is relative to the working folder
    shared = tmp_path / "shared"
    with ThreadPoolExecutor(4) as pool:  # two into one explicit folder, two into the default one
        jobs = [pool.submit(launch, demo_workers.say, 2, args=(f"launch {i}", 1.0), echo=False,
                            log_dir=shared if i < 2 else None) for i in range(4)]
        results = [job.result(timeout=120) for job in jobs]
    assert results == [[f"launch {i}"] * 2 for i in range(4)]
    logs = {str(path.relative_to(shared)): path.read_text() for path in shared.rglob("rank_*/train.log")}
    for i in range(2):  # neither launch into the shared folder lost its logs to the other
        assert sum(f"launch {i}" in text for text in logs.values()) == 2, logs.keys()
    latest = [(tmp_path / "logs" / f"rank_{r}" / "train.log").read_text() for r in range(2)]
    winner = next(i for i in (2, 3) if f"launch {i}" in latest[0])
    assert f"launch {winner}" in latest[1], "logs/rank_0 and logs/rank_1 must come from the same launch"
    launched = (tmp_path / "logs" / "latest_launch.txt").read_text().strip()
    assert f"launch {winner}" in (tmp_path / "logs" / "launches" / launched / "rank_1" / "train.log").read_text()


def test_every_start_method_gives_the_same_results(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_LAUNCH_START_METHOD", raising=False)
    assert launch_module._start_method() == ("forkserver" if sys.platform.startswith("linux") else "spawn")
    results = {}
    for method in ("spawn", "forkserver", "fork"):
        monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", method)
        results[method] = launch(demo_workers.allreduce_demo, 2, log_dir=tmp_path / method, timeout_s=30)
    assert results["forkserver"] == results["spawn"] == results["fork"]
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "threads")
    with pytest.raises(ValueError, match="COURSE_LAUNCH_START_METHOD='threads'"):
        launch(demo_workers.allreduce_demo, 2, log_dir=tmp_path / "bad", timeout_s=30)


def test_fork_server_ranks_see_the_callers_environment_and_folder_as_they_are_now(tmp_path, monkeypatch):
    """The fork server keeps the environment it started with; its ranks must see the caller's, as spawned ranks do."""
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "forkserver")
    monkeypatch.setenv("COURSE_TEST_VALUE", "before")
    names = ("COURSE_TEST_VALUE", "COURSE_TEST_ADDED", "OMP_NUM_THREADS")
    first = launch(demo_workers.environment, 2, args=(names,), log_dir=tmp_path / "a", timeout_s=30, echo=False)
    assert [r["env"]["COURSE_TEST_VALUE"] for r in first] == ["before", "before"]
    monkeypatch.setenv("COURSE_TEST_VALUE", "after")
    monkeypatch.setenv("COURSE_TEST_ADDED", "new")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    second = launch(demo_workers.environment, 2, args=(names,), log_dir=tmp_path / "b", timeout_s=30, echo=False,
                    threads_per_rank=1)
    assert [r["env"] for r in second] == [{"COURSE_TEST_VALUE": "after", "COURSE_TEST_ADDED": "new",
                                           "OMP_NUM_THREADS": "1"}] * 2
    assert {r["cwd"] for r in second} == {str(tmp_path / "elsewhere")}


def test_fork_falls_back_to_spawn_where_a_forked_child_could_not_run_backward(tmp_path, monkeypatch):
    assert launch_module._fork_keeps_autograd()  # here a forked child runs backward
    monkeypatch.setenv("COURSE_LAUNCH_START_METHOD", "fork")
    assert launch_module._start_method() == "fork"

    def backward_fails(*args, **kwargs):
        raise RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing")

    with monkeypatch.context() as patch:  # what a child forked after FSDP2's backward meets with torch 2.11
        patch.setattr("torch.Tensor.backward", backward_fails)
        assert not launch_module._fork_keeps_autograd()
    monkeypatch.setattr(launch_module, "_fork_keeps_autograd", lambda: False)
    assert launch_module._start_method() == "spawn"
    assert [r["after"] for r in launch(demo_workers.allreduce_demo, 2, log_dir=tmp_path, timeout_s=30)] == [3.0, 3.0]


def test_launches_at_the_same_time_keep_their_own_logs(tmp_path, monkeypatch):

    monkeypatch.chdir(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: launch(demo_workers.allreduce_demo, world_size=2, echo=False), range(2)))
    assert all([r["after"] for r in result] == [3.0, 3.0] for result in results)
    runs = sorted((tmp_path / "logs" / "launches").iterdir())
    assert len(runs) == 2, runs
    for run in runs:
        for rank in range(2):
            log = (run / f"rank_{rank}" / "train.log").read_text()
            assert log.count("after all_reduce: 3") == 1, log  # this launch's lines only, once
    latest = (tmp_path / "logs" / "rank_1" / "train.log").read_text()
    assert latest in {(run / "rank_1" / "train.log").read_text() for run in runs}


def test_a_script_that_launches_without_a_main_guard_is_told_what_to_add(tmp_path):
    import subprocess

    script = tmp_path / "no_guard.py"
    script.write_text("from course_lib.runtime.launch import launch\n"
                      "from course_lib.runtime.demo_workers import allreduce_demo\n"
                      "launch(allreduce_demo, 2, log_dir='logs', timeout_s=20)\n")
    env = {k: v for k, v in os.environ.items() if k != "COURSE_LAUNCH_START_METHOD"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr, done.stderr[-2000:]


def test_ranks_of_one_machine_talk_over_the_loopback_interface(tmp_path, monkeypatch):
    """gloo finds its address from the host name, which on a laptop on a VPN is not this machine's loopback: launch
    and torchrun-started ranks with a loopback MASTER_ADDR set GLOO_SOCKET_IFNAME (lo, lo0 on macOS) unless it is set."""
    from course_lib.runtime.env import gloo_on_loopback, loopback_interface

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    interface = loopback_interface()
    assert interface == ("lo0" if sys.platform == "darwin" else "lo")
    assert gloo_on_loopback("127.0.0.1") == {"GLOO_SOCKET_IFNAME": interface}
    assert gloo_on_loopback("10.1.2.3") == {}, "ranks on other machines: leave gloo to find its interface"
    seen = launch(demo_workers.environment, 2, args=(["GLOO_SOCKET_IFNAME"],), log_dir=tmp_path / "a", echo=False)
    assert [r["env"]["GLOO_SOCKET_IFNAME"] for r in seen] == [interface] * 2
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)  # the user's own setting wins (here: the same interface)
    assert gloo_on_loopback("127.0.0.1") == {}
