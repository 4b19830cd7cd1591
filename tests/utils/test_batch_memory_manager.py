"""UserBatchMemoryManager: Opacus's BatchMemoryManager at the user level (issue 17)."""

import pytest
import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager

from trl_userdp.utils import UserBatchMemoryManager
from trl_userdp.utils.batch_memory_manager import whole_user_chunks

from ..helpers import linear_loss, private_linear


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("clip", [1e6, 0.05], ids=["unclipped", "clipped"])
def test_physical_batches_of_whole_users_give_the_one_batch_update(clip, mode):
    """Same seeds: the same users, per-user averages, noise and accounting as the whole draw in one batch; every
    physical batch has at most max_physical_batch_size rows and only whole users."""
    results = []
    for physical in (None, 7):
        torch.manual_seed(0)
        engine, model, optimizer, loader = private_linear(
            noise_multiplier=0.7, max_samples_per_user=5, users_per_batch=6, sampling_seed=3, noise_seed=4,
            lr=0.5, max_grad_norm=clip, grad_sample_mode=mode)
        sizes, steps = [], 0
        if physical is None:
            batches = loader
        else:
            manager = UserBatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer)
            batches = manager.__enter__()
        for x, y in batches:
            sizes.append(len(x))
            if physical is not None:
                users = loader.last_row_users
                assert len(x) <= physical and len(users) == len(x)
            if len(x):
                linear_loss(model(x), y).backward()
            optimizer.step()  # Opacus's loop: step after every physical batch; only the draw's last one steps
            optimizer.zero_grad()
            steps += 1
        results.append((model.weight.detach().clone(), engine.accountant.history, sizes))
    (w1, h1, s1), (w7, h7, s7) = results
    torch.testing.assert_close(w7, w1, atol=1e-6, rtol=1e-5)
    assert h7 == h1 == [(0.7, 6 / 30, 5)]
    assert len(s7) > len(s1) and sum(s7) == sum(s1)  # the draws were split, and no row was lost


def test_chunks_keep_users_whole_and_refuse_a_user_larger_than_the_cap():
    users = torch.tensor([0, 0, 0, 4, 4, 7, 9, 9, 9, 9])
    assert [c.tolist() for c in whole_user_chunks(users, 5)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert [c.tolist() for c in whole_user_chunks(users, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert [c.tolist() for c in whole_user_chunks(users[:0], 4)] == [[]]
    with pytest.raises(ValueError, match="a user's rows cannot be split"):
        whole_user_chunks(users, 3)


def test_opacus_batch_memory_manager_over_users_is_a_clear_error():
    """It used to fail deep inside the model (`linear(): argument 'input' must be Tensor, not list`)."""
    _, model, optimizer, loader = private_linear(noise_multiplier=0.7, max_samples_per_user=5, users_per_batch=6)
    with pytest.raises(ValueError, match="cutting users apart; use trl_userdp.utils.UserBatchMemoryManager"):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as batches:
            next(iter(batches))
    with pytest.raises(ValueError, match="below max_samples_per_user=5"):
        UserBatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer)


def test_several_processes_are_refused():
    """Each rank's shard would split into its own number of physical batches, so the ranks' steps (and all-reduces)
    would not line up; micro_batches keeps the same count on every rank."""
    from torch.utils.data import TensorDataset

    from trl_userdp.data import UserDataLoader

    data = TensorDataset(torch.zeros(8, 2))
    loader = UserDataLoader(data, users_per_batch=2.0, user_ids=[0, 0, 1, 1, 2, 2, 3, 3], num_replicas=2, rank=0,
                            seed=0)
    with pytest.raises(ValueError, match="runs in one process"):
        UserBatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=None)


def test_a_draw_ended_by_the_budget_guard_leaves_no_signal_behind():
    """Each physical batch's signal is used by its own step(), also when the budget guard stops the draw's last one:
    a signal left in the queue would make the next draw step on its first physical batch."""
    import trl_userdp

    _, model, optimizer, loader = private_linear(noise_multiplier=0.7, max_samples_per_user=5, users_per_batch=6)

    def exhausted():
        raise trl_userdp.PrivacyBudgetExhausted("spent")

    optimizer.budget_guard, optimizer.skip_when_exhausted = exhausted, True
    optimizer.signal_skip_step_whole_users(do_skip=True)
    assert optimizer.step() is None and optimizer._is_last_step_skipped
    optimizer.signal_skip_step_whole_users(do_skip=False)
    assert optimizer.step() is None and not optimizer._is_last_step_skipped
    assert optimizer._step_skip_queue == []
