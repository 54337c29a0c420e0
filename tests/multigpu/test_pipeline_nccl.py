"""Pipeline parallelism from scratch (course_lib.pipeline_parallel.stage.PipelineRunner) with the 1F1B schedule, one
stage per GPU, activations and their gradients sent as NCCL point-to-point messages: equals one process.

    pytest -m multigpu tests/multigpu/test_pipeline_nccl.py
"""

import pytest

pytestmark = [pytest.mark.multigpu, pytest.mark.distributed]
STEPS, GLOBAL_BATCH, SEQ_LEN = 3, 8, 32


def test_one_f_one_b_pipeline_equals_one_process(multigpu, tmp_path):
    from course_lib.pipeline_parallel.workers import pipeline_train, reference_run

    n_stages = multigpu.world_size(2, 4)
    # One layer per stage at least; SGD with momentum, whose update is linear in the gradient (the pipeline adds the
    # micro-batches' gradients in another order: AdamW would magnify the last bits of near-zero ones).
    settings = dict(steps=STEPS, preset="tiny", config_overrides={"n_layer": max(2, n_stages)},
                    global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, optimizer="sgd", lr=0.1)
    micro_batches = 2 * n_stages
    ranks = multigpu.launch({"1f1b": (pipeline_train, dict(schedule="1f1b", micro_batches=micro_batches, **settings))},
                            n_stages, tmp_path)
    reference = reference_run(**settings)
    covered = set()
    for stage, result in enumerate(ranks):
        run, where = result["1f1b"], f"1F1B, stage {stage} of {n_stages}"
        assert run["stage"] == stage, where
        multigpu.assert_grads_close(run["grads"], {n: reference["grads"][n] for n in run["grads"]},
                                    where=f"{where}, first step")
        multigpu.assert_sgd_params_close(run["params"], reference["params"], where=where, names=run["params"])
        covered |= set(run["params"])
        assert run["peak_in_flight"][0] == n_stages - stage, f"{where}: 1F1B keeps n_stages - stage micro-batches"
        assert run["bytes_sent"][0]["activations"] > 0 or stage == n_stages - 1, where
    assert covered == set(reference["params"]), "the stages together hold every parameter of the model"
    assert all(result["1f1b"]["losses"] == [] for result in ranks[:-1]), "only the last stage computes the loss"
    multigpu.assert_losses_close(ranks[-1]["1f1b"]["losses"], reference["losses"], where="last stage")
