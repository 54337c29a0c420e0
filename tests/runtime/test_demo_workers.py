"""Session C's rank workers: barriers, aggregated logs, ranked checkpoints across world sizes, data per rank,
and the compute/communication split of the scaling sweep — each checked against what must hold."""

import json
import os

import pytest
import torch

from course_lib.checkpoint.ranked import load_full_parameters
from course_lib.checkpoint.workers import load_ranked_here, refuse_then_reshard
from course_lib.core.model import GPT, GPTConfig
from course_lib.data_parallel.experiment_workers import (
    data_per_rank,
    mapped_files,
    scaling_sweep,
)
from course_lib.data_parallel.loading import (
    TokenWindowDataset,
    rank_shards,
    write_token_shards,
)
from course_lib.observability.experiment_log import read_tensorboard_scalars
from course_lib.data_parallel.collectives import gather_to_rank0, mean_over_ranks, rank_tag
from course_lib.checkpoint.workers import barrier_race, train_logged
from course_lib.runtime.launch import RankFailure, launch

pytestmark = pytest.mark.distributed


def helpers_worker() -> dict:
    """Module level, so spawned ranks can import it: one node per rank, then the three helpers."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    rank = torch.distributed.get_rank()
    return {"tag": rank_tag(), "mean": mean_over_ranks(float(rank)), "gathered": gather_to_rank0({"rank": rank})}


def test_helpers_tag_reduce_and_gather(tmp_path):
    ranks = launch(helpers_worker, 3, log_dir=tmp_path, echo=False)
    assert [r["tag"] for r in ranks] == [f"[node {r} | local {r} | rank {r}]" for r in range(3)]
    assert all(r["mean"] == pytest.approx(1.0) for r in ranks)  # (0 + 1 + 2) / 3, on every rank
    assert ranks[0]["gathered"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert ranks[1]["gathered"] is None and ranks[2]["gathered"] is None


def test_missing_barrier_reads_stale_or_missing_checkpoints(tmp_path):
    race = launch(barrier_race, 2, kwargs=dict(directory=str(tmp_path / "race"), rounds=2, save_seconds=0.5),
                  log_dir=tmp_path / "logs", echo=False)
    for rank in race:
        assert rank["with barrier"] == rank["expected"] == [1, 2]
    assert race[0]["without barrier"] == [1, 2]  # the writer always reads its own file
    assert race[1]["without barrier"] != [1, 2]  # the reader was faster than rank 0's slow write
    assert set(race[1]["without barrier"]) <= {"missing", 1, 2}
    assert "expected step 1, loaded" in (tmp_path / "logs" / "rank_1" / "train.log").read_text()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    kwargs = dict(out_dir=str(root / "run"), data_dir=str(root / "data"), steps=6, micro_batch=2, seq_len=32,
                  log_every=3, ckpt_every=3)
    return root, launch(train_logged, 2, kwargs=kwargs, log_dir=root / "logs", echo=False)


def test_train_logged_aggregates_and_checkpoints(trained):
    root, ranks = trained
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)  # replicas in sync
    rows = ranks[0]["rows"]
    assert [row["step"] for row in rows] == [3, 6] and ranks[1]["rows"] == []  # rank 0 alone writes
    for row in rows:
        per_rank = row["per_rank"]
        assert [r["rank"] for r in per_rank] == [0, 1]
        assert row["mean_loss"] == pytest.approx(sum(r["loss"] for r in per_rank) / 2)
        assert row["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in per_rank))
        assert row["slowest_step_ms"] == max(r["step_ms"] for r in per_rank)
    on_disk = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == rows
    scalars = read_tensorboard_scalars(root / "run" / "tb")  # the same numbers, one TensorBoard curve each
    assert {"train/mean_loss", "train/loss_rank_0", "train/loss_rank_1"} <= set(scalars)
    assert [step for step, _ in scalars["train/loss_rank_1"]] == [3, 6]
    assert scalars["train/loss_rank_1"][0][1] == pytest.approx(rows[0]["loss_rank_1"], rel=1e-6)
    # The ranks read different shards, so their losses differ; the logged loss is their window mean.
    assert ranks[0]["local"][0]["loss"] != ranks[1]["local"][0]["loss"]
    assert rows[0]["per_rank"][1]["loss"] == pytest.approx(sum(r["loss"] for r in ranks[1]["local"][:3]) / 3)
    assert "[node 0 | local 1 | rank 1] step 6 | my loss" in (root / "logs" / "rank_1" / "train.log").read_text()
    assert ranks[0]["checkpoints"] == [str(root / "run" / "step_00003"), str(root / "run" / "step_00006")]
    params, manifest = load_full_parameters(root / "run" / "step_00006")
    assert manifest["world_size"] == 2 and manifest["step"] == 6
    torch.testing.assert_close(torch.cat([p.reshape(-1) for p in params.values()]), ranks[0]["params"], rtol=0, atol=0)


def test_checkpoint_loads_at_the_same_and_at_another_world_size(trained, tmp_path):
    root, ranks = trained
    final = str(root / "run" / "step_00006")
    same = launch(load_ranked_here, 2, args=(final,), log_dir=tmp_path, echo=False)
    for rank in same:
        assert not rank["resharded"] and rank["extra"] == {"batches_read": 6, "rank": rank["rank"]}
        torch.testing.assert_close(rank["params"], ranks[0]["params"], rtol=0, atol=0)
    with pytest.raises(RankFailure, match="written by 2 ranks but is being loaded by 3"):
        launch(load_ranked_here, 3, args=(final,), log_dir=tmp_path, echo=False)
    other = launch(refuse_then_reshard, 3, args=(final,), log_dir=tmp_path, echo=False)
    for rank in other:
        assert "reshard=True" in rank["refused"] and rank["resharded"] and rank["extra"] == {}
        torch.testing.assert_close(rank["params"], ranks[0]["params"], rtol=0, atol=0)


def test_mapped_files_lists_only_what_was_mapped(tmp_path):
    write_token_shards(torch.randint(0, 256, (400,)), tmp_path, 4)
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps on this system")
    dataset = TokenWindowDataset(tmp_path / "shard_00002.bin", seq_len=8)
    assert mapped_files(str(tmp_path)) == []
    dataset.tokens()
    assert mapped_files(str(tmp_path)) == ["shard_00002.bin"]


def test_data_per_rank_maps_own_shards_and_shows_the_slow_rank(tmp_path):
    write_token_shards(torch.randint(0, 256, (8000,)), tmp_path / "shards", 4)
    ranks = launch(data_per_rank, 2, args=(str(tmp_path / "shards"),),
                   kwargs=dict(seq_len=16, micro_batch=4, steps=3, configs=({"num_workers": 0},), slow_rank=1,
                               sample_delay_s=0.01), log_dir=tmp_path / "logs", echo=False)
    for rank in ranks:
        if rank["mapped"]:  # Linux
            assert rank["mapped"] == [f"shard_{k:05d}.bin" for k in rank_shards(4, rank["rank"], 2)]
    fast, slow = ranks[0]["configs"][0], ranks[1]["configs"][0]
    assert slow["slow"] and not fast["slow"]
    assert slow["wait_ms"] >= 4 * 10  # four windows of 10 ms each per batch
    assert fast["wait_ms"] < slow["wait_ms"] / 4
    assert fast["rest_ms"] > 0.5 * slow["wait_ms"]  # the fast rank waited for the slow one in the all-reduce


def test_scaling_sweep_splits_compute_and_communication(tmp_path):
    ranks = launch(scaling_sweep, 2, kwargs=dict(world_sizes=(1, 2), steps=2, warmup=1, micro_batch=2, seq_len=16),
                   threads_per_rank=1, log_dir=tmp_path, echo=False)
    assert sorted(ranks[0]["groups"]) == [1, 2] and sorted(ranks[1]["groups"]) == [2]
    n_params = GPT(GPTConfig.from_preset("tiny", block_size=16)).num_params()
    for n, group in ranks[0]["groups"].items():
        assert group["grad_bytes"] == 4 * n_params
        assert 0 < group["compute_s"] <= group["step_s"]
        assert group["comm_s"] == pytest.approx(group["step_s"] - group["compute_s"])
        assert group["tokens_per_s"] == pytest.approx(n * 2 * 16 / group["step_s"])
    torch.testing.assert_close(ranks[0]["groups"][2]["params"], ranks[1]["groups"][2]["params"], rtol=0, atol=0)
    assert not torch.equal(ranks[0]["groups"][1]["params"], ranks[0]["groups"][2]["params"])  # other data
    with pytest.raises(RankFailure, match=r"launch max\(world_sizes\)=4 ranks, got 2"):
        launch(scaling_sweep, 2, kwargs=dict(world_sizes=(1, 4)), log_dir=tmp_path, echo=False)
