"""course_lib.parity: the pieces every parity check shares behave as the checks assume."""

import pytest
import torch

from course_lib.parity import (flat_parameters, global_batches, gradients, local_rows, seeded_gpt,
                                single_process_run, train_whole_batches)


def test_seeded_gpt_is_the_same_model_for_the_same_seed_only():
    a, b, c = seeded_gpt(0), seeded_gpt(0), seeded_gpt(1)
    torch.testing.assert_close(flat_parameters(a), flat_parameters(b))
    assert not torch.equal(flat_parameters(a), flat_parameters(c))
    assert seeded_gpt(0, "tiny", block_size=16).config.block_size == 16


def test_global_batches_repeat_and_local_rows_tile_the_batch():
    first, again = global_batches(2, 6, 8, seed=3), global_batches(2, 6, 8, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert first[0].shape == (6, 8) and not torch.equal(first[0], first[1])
    parts = [local_rows(first[0], rank, 3) for rank in range(3)]
    torch.testing.assert_close(torch.cat(parts), first[0])
    with pytest.raises(ValueError, match="6 rows does not split over world_size=4"):
        local_rows(first[0], 0, 4)


def test_train_whole_batches_records_first_gradients_losses_and_final_parameters():
    batches = global_batches(2, 4, 16, 0)
    fresh = seeded_gpt(0)
    loss = fresh(batches[0], targets=batches[0])[1]
    loss.backward()
    model = seeded_gpt(0)
    before = flat_parameters(model)
    result = train_whole_batches(model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    assert len(result["losses"]) == 2 and result["losses"][0] == loss.item()
    for name, grad in gradients(fresh).items():
        torch.testing.assert_close(result["grads"][name], grad, msg=name)  # taken before the first step
    assert set(result["grads"]) == set(result["params"]) == {n for n, _ in model.named_parameters()}
    assert not torch.equal(flat_parameters(model), before)
    assert gradients(model)["norm_f.weight"] is not None  # the last step's, still there
    reference = single_process_run(steps=2)
    assert reference["grads"].keys() == reference["params"].keys() and len(reference["losses"]) == 2
