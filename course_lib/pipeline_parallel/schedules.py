"""Pipeline schedules on paper: which micro-batch each stage runs when, the bubble, and the bytes sent.

GPipe runs every forward, then every backward; 1F1B warms up with n_stages - stage forwards, then alternates
one forward and one backward, then drains. simulate_schedule draws the ideal timeline of either, the bubble
fraction is (p - 1) / (m + p - 1) for both, and pipeline_comm_bytes is what crosses each stage boundary.
course_lib.pipeline_parallel.stage runs these schedules on real ranks.

    from course_lib.pipeline_parallel.schedules import schedule_actions, predicted_bubble_fraction
    schedule_actions("1f1b", n_stages=4, stage=0, micro_batches=8)   # [('F', 0), ..., ('B', 7)]
"""

from __future__ import annotations

from course_lib.core.checks import positive_int

COMPUTE_KINDS = ("forward", "backward")

def gpipe_schedule(n_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """Fill, then drain: all m forwards, then all m backwards. ('F', i) / ('B', i) per micro-batch i."""
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def one_f_one_b_schedule(n_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """Warm-up forwards (more on early stages), then one forward one backward, then the remaining backwards.

    Stage s starts n_stages - s - 1 forwards ahead, so when its first backward arrives it holds n_stages - s
    micro-batches, and from then on it frees one for every one it starts (Megatron-LM's non-interleaved 1F1B).
    """
    warmup = min(n_stages - stage - 1, micro_batches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(micro_batches - warmup, micro_batches)]


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def schedule_actions(name: str, n_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """The actions of `stage` under schedule `name` ('gpipe' or '1f1b'), checked arguments."""
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage must be in 0..{n_stages - 1}, got {stage!r}")
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    positive_int("micro_batches", micro_batches)
    return SCHEDULES[name](n_stages, stage, micro_batches)


def max_in_flight(actions: list[tuple[str, int]]) -> int:
    """Most micro-batches whose forward has run and backward has not: activations the stage must keep."""
    alive = peak = 0
    for kind, _ in actions:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak


def simulate_schedule(name: str, n_stages: int, micro_batches: int, forward_time: float = 1.0,
                      backward_time: float = 2.0) -> tuple[list[list[tuple]], list[list[int]]]:
    """Ideal timeline (no communication cost, equal stages): per-stage intervals and their micro-batch ids."""
    todo = [schedule_actions(name, n_stages, s, micro_batches) for s in range(n_stages)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, stage) -> finish time
    free = [0.0] * n_stages
    intervals, ids = [[] for _ in range(n_stages)], [[] for _ in range(n_stages)]
    while any(todo):
        progressed = False
        for s in range(n_stages):
            while todo[s]:
                kind, i = todo[s][0]
                needs = ("F", i, s - 1) if kind == "F" else ("B", i, s + 1)
                if needs[2] in (-1, n_stages):
                    needs = None  # stage 0 reads the data; the last stage's backward starts from its loss
                if needs is not None and needs not in done:
                    break
                start = max(free[s], done[needs] if needs else 0.0)
                free[s] = done[(kind, i, s)] = start + (forward_time if kind == "F" else backward_time)
                intervals[s].append(("forward" if kind == "F" else "backward", start, free[s]))
                ids[s].append(i)
                todo[s].pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name!r} deadlocks: every stage waits for another")
    return intervals, ids


def predicted_bubble_fraction(n_stages: int, micro_batches: int) -> float:
    """Idle share of each stage's step when stages are equal and communication is free: (p-1)/(m+p-1)."""
    return (n_stages - 1) / (micro_batches + n_stages - 1)


def measured_bubble_fraction(per_rank: list[list[tuple]]) -> float:
    """1 - compute time / step time, averaged over ranks; the step runs from the first forward starting
    anywhere to the last backward ending anywhere (a shared clock: time.monotonic() on one machine)."""
    compute = [[iv for iv in intervals if iv[0] in COMPUTE_KINDS] for intervals in per_rank]
    start = min(iv[1] for intervals in compute for iv in intervals)
    window = max(iv[2] for intervals in compute for iv in intervals) - start
    return sum(1 - sum(end - begin for _, begin, end in intervals) / window for intervals in compute) / len(compute)


def with_idle(per_rank: list[list[tuple]]) -> list[list[tuple]]:
    """The compute intervals plus 'idle' intervals filling every gap of the common step window."""
    compute = [sorted((iv for iv in intervals if iv[0] in COMPUTE_KINDS), key=lambda iv: iv[1])
               for intervals in per_rank]
    start = min(iv[1] for intervals in compute for iv in intervals)
    end = max(iv[2] for intervals in compute for iv in intervals)
    filled = []
    for intervals in compute:
        cursor, rank_intervals = start, []
        for iv in intervals + [("end", end, end)]:
            if iv[1] > cursor:
                rank_intervals.append(("idle", cursor, iv[1]))
            if iv[0] != "end":
                rank_intervals.append(iv)
            cursor = max(cursor, iv[2])
        filled.append(rank_intervals)
    return filled


def pipeline_comm_bytes(n_stages: int, micro_batches: int, micro_batch_size: int, seq_len: int, n_embd: int,
                        bytes_per_element: int = 4, vocab_size: int | None = None) -> dict:
    """Bytes one training step sends between stages: b*T*h per micro-batch per boundary, each way.

    forward = activations, backward = their gradients, both summed over the n_stages - 1 boundaries.
    With vocab_size, tied_grad = the embedding gradient the first and last stage all-reduce (each of the
    two sends that many bytes in a two-rank ring).
    """
    message = micro_batch_size * seq_len * n_embd * bytes_per_element
    forward = (n_stages - 1) * micro_batches * message
    result = {"message": message, "forward": forward, "backward": forward, "total": 2 * forward}
    if vocab_size is not None:
        result["tied_grad"] = vocab_size * n_embd * bytes_per_element if n_stages > 1 else 0
    return result
