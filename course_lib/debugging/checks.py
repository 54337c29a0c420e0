"""The debugging lab's checks: a diagnosis is well formed, a fixed job computes what one process computes.

A diagnosis is a dict with three fields:
    ranks     the ranks that run a branch of the script the others skip: a list of rank numbers, or "all" when
              every rank runs the same code (the data, not the code, may still differ between ranks)
    function  the name of the script's function (or class) where the cause is, the one a fix rewrites
    cause     one letter of CAUSES
"""

from __future__ import annotations

import ast

import torch

from course_lib.debugging.jobs import script_of
from course_lib.debugging.run import DDP_BUCKETS

CAUSES = {
    "A": "a collective that only some ranks call",
    "B": "the ranks call the same collectives, but not in the same order",
    "C": "the ranks hand one collective tensors of different shapes",
    "D": "one rank gets more batches than another",
    "E": "every epoch reads the data in the same order",
    "F": "the replicas do not hold the same weights",
    "G": "a parameter that never gets a gradient",
    "H": "the names in a saved state dict are not the names of the model that loads it",
    "I": "the gradients cross the network more often than they need to",
    "J": "the gradients are divided by the number of ranks twice",
    "K": "the gradients are not divided by the number of micro-batches",
    "L": "a file is read before it has been completely written",
}
"""The causes a diagnosis chooses from (the same list in both debugging labs)."""


def script_names(job: str) -> set[str]:
    """The functions and classes defined at the top level of a job's script."""
    tree = ast.parse(script_of(job))
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def diagnosis_of(diagnosis, job: str) -> tuple:
    """(ranks, function, cause) of a diagnosis dict, checked and normalised: ranks is "all" or a sorted tuple of
    ints. Raises ValueError naming the field that is missing or not one of the allowed values."""
    if type(diagnosis) is not dict:
        raise ValueError(f"a diagnosis is a dict with the keys ranks, function and cause, got {type(diagnosis).__name__}")
    missing = {"ranks", "function", "cause"} - set(diagnosis)
    if missing:
        raise ValueError(f"the diagnosis has no {', '.join(sorted(missing))}: give ranks, function and cause")
    ranks, function, cause = diagnosis["ranks"], diagnosis["function"], diagnosis["cause"]
    if type(ranks) is str and ranks == "all":
        ranks = "all"
    elif type(ranks) in (list, tuple) and ranks and all(type(r) is int and r >= 0 for r in ranks):
        ranks = tuple(sorted(set(ranks)))
    else:
        raise ValueError(f'ranks is "all" or a list of rank numbers such as [0] or [1, 2], got {ranks!r}')
    names = script_names(job)
    if type(function) is not str or function not in names:
        raise ValueError(f"function is the name of a function or class of the job's script ({', '.join(sorted(names))}),"
                         f" got {function!r}")
    if type(cause) is not str or cause not in CAUSES:
        raise ValueError(f"cause is one letter of CAUSES ({', '.join(CAUSES)}), got {cause!r}")
    return ranks, function, cause


def assert_fixed(run, reference: dict, what: str, *, whole: bool = True) -> None:
    """Every rank finished; its losses and gradient norms at every step equal one process on the same global
    batches (`reference`, from one_process). whole: also its validation and test losses and its final parameters,
    the replicas hold the same weights, and DDP sends the gradients as often as the correct job does.

    Tolerances: the ranks' gradients are summed in another order than one process sums them (float32 rounding),
    and AdamW divides each step by sqrt(v): a weight whose gradient is nearly zero can move by lr x that rounding.
    """
    if not run.ok:
        raise AssertionError(f"{what}: the job still fails.\n{run.failure}")
    for result in run.results:
        rank = result["rank"]
        steps = [record["step"] for record in result["history"]]
        expected = [record["step"] for record in reference["history"]]
        assert steps == expected, f"{what}, rank {rank}: it logged steps {steps}; one process takes steps {expected}"
        keys = (("loss", 1e-5), ("grad_norm", 1e-4), ("val_loss", 1e-5)) if whole else (("loss", 1e-5), ("grad_norm", 1e-4))
        for mine, theirs in zip(result["history"], reference["history"]):
            for key, rtol in keys:
                if key in theirs or key in mine:
                    assert key in mine and key in theirs, (f"{what}, rank {rank}, step {mine['step']}: one process "
                                                           f"{'logs' if key in theirs else 'does not log'} a {key}")
                    torch.testing.assert_close(float(mine[key]), float(theirs[key]), rtol=rtol, atol=1e-5,
                                               msg=lambda m: f"{what}, rank {rank}, step {mine['step']}: the {key} "
                                                             f"is not one process's\n{m}")
        if not whole:
            continue
        torch.testing.assert_close(float(result["test_loss"]), float(reference["test_loss"]), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what}, rank {rank}: the test loss is not one process's\n{m}")
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-3, atol=1e-4, msg=lambda m: (
                f"{what}, rank {rank}: after training, {name} is not what one process computes\n{m}"))
    if whole:
        assert_replicas_agree(run, what)
        expected = reference["collectives"].get(DDP_BUCKETS, 0)
        for rank, counts in enumerate(run.collectives):
            assert counts.get(DDP_BUCKETS, 0) == expected, (
                f"{what}, rank {rank}: DDP all-reduced gradient buckets {counts.get(DDP_BUCKETS, 0)} times; the correct "
                f"job does it {expected} times (once per bucket and optimizer step)")


def assert_replicas_agree(run, what: str) -> None:
    """Every rank finished, took as many steps as the others, and ends with the same parameters."""
    if not run.ok:
        raise AssertionError(f"{what}: the job still fails.\n{run.failure}")
    steps = {r["rank"]: r["steps"] for r in run.results}
    assert len(set(steps.values())) == 1, f"{what}: the ranks took different numbers of steps: {steps}"
    last = {r["rank"]: r["history"][-1]["params"] if r["history"] else None for r in run.results}
    assert len(set(last.values())) == 1, f"{what}: the replicas end with different parameters (checksums {last})"


def epoch_windows(module, config, world_size: int, epoch: int = 0) -> list[list[int]]:
    """The windows (dataset indices) each rank's loader yields in `epoch`, from a job's script (`run.script()`)
    and config: what `train` would read, without running it."""
    dataset, _ = module.build_data(config)
    read = []
    for rank in range(world_size):
        loader, sampler = module.make_loader(dataset, config, rank, world_size)
        sampler.set_epoch(epoch)
        read.append([int(i) for batch in loader.batch_sampler for i in batch])
    return read


def assert_windows_shared_out(module, config, world_size: int, what: str) -> None:
    """In every epoch the ranks read disjoint windows, as many each, and together all but fewer than one global
    batch of them (what a sampler that pads or drops evenly gives)."""
    dataset, _ = module.build_data(config)
    for epoch in range(config.epochs):
        read = epoch_windows(module, config, world_size, epoch)
        counts = [len(r) for r in read]
        assert len(set(counts)) == 1, f"{what}, epoch {epoch}: the ranks read {counts} windows"
        everyone = [i for r in read for i in r]
        assert len(set(everyone)) == len(everyone), f"{what}, epoch {epoch}: a window is read by two ranks or twice"
        unread = len(dataset) - len(everyone)
        assert unread < world_size * config.micro_batch * config.grad_accum, (
            f"{what}, epoch {epoch}: {unread} of {len(dataset)} windows are never read")
