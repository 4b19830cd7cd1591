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


@pytest.mark.parametrize("steps,epochs", [(None, None), (3, 1.0), (0, None), (2.5, None), (None, 0.0), (True, None)])
def test_bad_plans_raise(steps, epochs):
    with pytest.raises(ValueError):
        check_steps(steps, epochs, 0.1)
