"""The step plan: E epochs over a user-level loader are the steps transformers' Trainer runs."""

import math

import pytest

from trl_userdp.validators import check_steps, steps_per_epoch


@pytest.mark.parametrize("epochs,q", [(5, 6 / 26), (1.1, 0.25), (0.5, 0.2), (3, 0.02), (2.5, 0.3), (1, 1.0)])
def test_a_plan_in_epochs_counts_the_trainers_steps(epochs, q):
    per_epoch = steps_per_epoch(q)
    assert per_epoch == round(1 / q) >= 1  # one pass of UserPoissonSampler
    # transformers.Trainer: max_steps = ceil(num_train_epochs * len(train_dataloader))
    assert check_steps(None, epochs, q) == math.ceil(epochs * per_epoch)


@pytest.mark.parametrize("steps,epochs,match", [
    (None, None, "exactly one"), (3, 1.0, "exactly one"), (0, None, "integer >= 1"), (2.5, None, "integer >= 1"),
    (None, 0.0, "epochs must be"), (True, None, "integer >= 1"),
])
def test_bad_plans_raise(steps, epochs, match):
    with pytest.raises(ValueError, match=match):
        check_steps(steps, epochs, 0.1)


def test_numpy_numbers_are_numbers():
    """A budget read from a NumPy array is accepted as what it is (issue 11, item 8)."""
    import numpy as np

    from trl_userdp.validators import check_delta, check_epsilon, check_max_samples_per_user

    assert check_epsilon(np.float32(3.0)) == 3.0 and isinstance(check_epsilon(np.float32(3.0)), float)
    assert check_delta(np.float32(1e-5)) == pytest.approx(1e-5)
    assert check_max_samples_per_user(np.int64(4)) == 4 and check_steps(np.int64(7), None, 0.1) == 7
    for bad in (np.float32(0.0), np.float32("nan"), True, None, "3"):
        with pytest.raises(ValueError, match="target_epsilon must be a finite number > 0"):
            check_epsilon(bad)
