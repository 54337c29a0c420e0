"""Session B's rank workers (course_lib.session_b_workers, course_lib.data_parallel.torch_ddp): collectives, bucket sweep,
torch DDP training with a sampler, no_sync accumulation, world sizes in one job, and GradScaler under DDP — each
checked against what must hold (one process, or algebra)."""

import pytest
import torch

from course_lib.core.model import GPT, GPTConfig
from course_lib.data_parallel.experiment_workers import bucket_sweep, world_size_sweep
from course_lib.data_parallel.torch_ddp import TokenWindows, ddp_train, train_and_accumulate
from course_lib.precision.workers import amp_ddp_overflow
from course_lib.runtime.launch import RankFailure, launch
from course_lib.runtime.spawn import spawnable
from course_lib.runtime.demo_workers import collectives_demo
from course_lib.parity import global_batches

pytestmark = pytest.mark.distributed


def window_sum(model, windows, info):
    """A rank metric for ddp_train (module level, so the spawned ranks can import it)."""
    return {"window_sum": int(sum(w.sum().item() for w in windows)), "metric_rank": info.rank}


def test_collectives_follow_their_definitions(tmp_path):
    ranks = launch(collectives_demo, 3, log_dir=tmp_path, echo=False)
    ops = {op: [r[op] for r in ranks] for op in ranks[0]}
    assert all(r["after"] == ops["broadcast"][0]["before"] for r in ops["broadcast"])
    assert all(r["after"] == [sum(x["before"][0] for x in ops["all_reduce"])] for r in ops["all_reduce"])
    for j, r in enumerate(ops["reduce_scatter"]):
        assert r["after"] == [sum(x["before"][j] for x in ops["reduce_scatter"])]
    assert all(r["after"] == [x["before"][0] for x in ops["all_gather"]] for r in ops["all_gather"])
    assert "all_gather" in (tmp_path / "rank_2" / "train.log").read_text()  # logged to the rank's file


def test_bucket_sweep_counts_buckets_and_overlaps(tmp_path):
    ranks = launch(bucket_sweep, 2, kwargs=dict(bucket_caps_mb=(0.05, 64.0), steps=1, warmup=0,
                                                timeline_variants=("naive", "0.05 MB"), timeline_steps=1),
                   log_dir=tmp_path, echo=False)
    variants = ranks[0]["variants"]
    n_tensors = len(list(GPT(GPTConfig.from_preset("small")).parameters()))
    assert variants["naive"]["allreduces_per_step"] == n_tensors
    assert variants["64 MB"]["allreduces_per_step"] == 1
    assert 1 < variants["0.05 MB"]["allreduces_per_step"] <= n_tensors
    for rank in ranks:
        bucketed = rank["timelines"]["0.05 MB"]
        backward_end = next(end for kind, _, end in bucketed if kind == "backward")
        launched = [start for kind, start, _ in bucketed if kind == "allreduce"]
        assert min(launched) < backward_end  # a bucket went out while backward was still running
        naive = rank["timelines"]["naive"]
        naive_backward_end = next(end for kind, _, end in naive if kind == "backward")
        assert all(start >= naive_backward_end for kind, start, _ in naive if kind == "allreduce")


def test_ddp_train_shards_syncs_and_records(tmp_path):
    kwargs = dict(steps=4, micro_batch=4, grad_accum_steps=2, seq_len=32, num_windows=40, log_every=1,
                  data_dir=str(tmp_path / "data"), rank_metric=window_sum)
    ranks = launch(ddp_train, 2, kwargs=kwargs, log_dir=tmp_path / "logs", echo=False)
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)  # replicas identical
    assert ranks[0]["samples_per_epoch"] == 20  # 40 windows over 2 ranks
    by_epoch = {}
    for rank in ranks:
        for _, epoch, indices in rank["indices"]:
            by_epoch.setdefault(epoch, []).append(set(indices))
    assert len(by_epoch) == 2  # 4 steps x 2 micro-batches x 4 samples = 32 > 20 per epoch
    for epoch, shards in by_epoch.items():
        union = set().union(*shards)
        assert len(union) == sum(len(s) for s in shards), f"epoch {epoch}: two micro-batches share a sample"
    first_epoch_order = [i for _, epoch, idx in ranks[0]["indices"] if epoch == 0 for i in idx]
    second_epoch_order = [i for _, epoch, idx in ranks[0]["indices"] if epoch == 1 for i in idx]
    assert first_epoch_order[:len(second_epoch_order)] != second_epoch_order  # set_epoch reshuffled
    for step in range(4):
        a, b = ranks[0]["records"][step], ranks[1]["records"][step]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"])  # the averaged gradient is the same everywhere
        assert a["grad_norm"] <= (a["local_grad_norm"] + b["local_grad_norm"]) / 2 * (1 + 1e-5)  # |mean| <= mean |.|
        assert a["tokens_seen"] == (step + 1) * 2 * 4 * 32 and a["allreduces"] == 1
        assert a["metric_rank"] == 0 and b["metric_rank"] == 1 and a["window_sum"] > 0
    assert "synced grad norm" in (tmp_path / "logs" / "rank_1" / "train.log").read_text()
    with pytest.raises(RankFailure, match="simulated failure in rank 1") as failure:
        launch(ddp_train, 2, kwargs={**kwargs, "fault": spawnable(rank_1_fails_at_step_1)}, log_dir=tmp_path / "fail",
               echo=False)
    assert failure.value.rank == 1


def rank_1_fails_at_step_1(rank, step):
    if rank == 1 and step == 1:
        raise RuntimeError(f"simulated failure in rank {rank} at step {step}")


def test_no_sync_accumulation_equals_one_process(tmp_path):
    micro_batch, accum, seq_len, world_size = 2, 3, 16, 2
    jobs = launch(train_and_accumulate, world_size,
                  kwargs=dict(train_kwargs=dict(steps=1, micro_batch=2, seq_len=16, num_windows=8, log_every=0,
                                                data_dir=str(tmp_path / "data")),
                              accumulation_kwargs=dict(micro_batch=micro_batch, grad_accum_steps=accum,
                                                       seq_len=seq_len)),
                  log_dir=tmp_path / "logs", echo=False)
    assert [len(job["train"]["records"]) for job in jobs] == [1, 1]  # the training ran first, in the same job
    ranks = [job["accumulation"] for job in jobs]
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", block_size=seq_len))
    batch = global_batches(1, micro_batch * accum * world_size, seq_len, 0)[0]
    model(batch, targets=batch)[1].backward()
    for rank in ranks:
        for variant in ("no_sync", "sync_every_micro_batch"):
            for name, param in model.named_parameters():
                torch.testing.assert_close(rank[variant]["grads"][name], param.grad, msg=f"{variant}: {name}")
        assert rank["sync_every_micro_batch"]["allreduces"] == accum * rank["no_sync"]["allreduces"]


def test_world_size_sweep_changes_nothing_but_speed(tmp_path):
    ranks = launch(world_size_sweep, 2, kwargs=dict(world_sizes=(1, 2), steps=2, warmup=1, global_batch=4,
                                                    seq_len=32, data_dir=str(tmp_path / "data")),
                   log_dir=tmp_path / "logs", echo=False)
    one, two = ranks[0]["groups"][1], [r["groups"][2] for r in ranks]
    assert 1 not in ranks[1]["groups"]  # rank 1 is not in the world-size-1 group
    first_losses = torch.tensor([g["losses"][0] for g in two])
    torch.testing.assert_close(first_losses.mean().item(), one["losses"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two[0]["params"], one["params"])
    assert len(one["step_s"]) == 2 and all(t > 0 for t in two[0]["step_s"])


def test_gradscaler_under_ddp_skips_on_every_rank(tmp_path):
    ranks = launch(amp_ddp_overflow, 2, kwargs=dict(steps=6, overflow_rank=1, overflow_step=3),
                   log_dir=tmp_path, echo=False)
    for rank in ranks:
        skipped = [r["step"] for r in rank["records"] if r["skipped"]]
        assert skipped == [3], f"rank {rank['rank']} skipped {skipped}"
        assert rank["records"][4]["scale"] == rank["records"][3]["scale"] / 2
    assert ranks[1]["records"][3]["injected_here"] and not ranks[0]["records"][3]["injected_here"]
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


def test_token_windows():
    dataset = TokenWindows(torch.arange(10, dtype=torch.uint8), seq_len=3)
    assert len(dataset) == 3
    index, window = dataset[2]
    assert index == 2 and window.tolist() == [6, 7, 8] and window.dtype == torch.long
    assert len(TokenWindows(torch.arange(10), seq_len=3, num_windows=2)) == 2
    with pytest.raises(ValueError, match="seq_len=20"):
        TokenWindows(torch.arange(10), seq_len=20)
