"""User-level randomized response (docs/mechanisms.md, M3, issue 4)."""

import math

import numpy as np
import pytest
from datasets import Dataset
from scipy import stats

from trl_userdp.accountants import compute_delta, compute_epsilon, randomized_response_event
from trl_userdp.mechanisms import PRIVATIZED_COLUMN, UserRandomizedResponse


def _pairs(n_users, per_user, extra=0):
    users = np.repeat(np.arange(n_users), per_user)
    users = np.concatenate([users, np.zeros(extra, dtype=int)])  # user 0 has `extra` rows beyond the bound
    n = len(users)
    return Dataset.from_dict({"chosen": [f"c{i}" for i in range(n)], "rejected": [f"r{i}" for i in range(n)],
                              "user_id": users.tolist()})


def test_flip_rate_over_1e5_labels_is_one_minus_sigmoid_of_eps_over_m():
    eps, m = 3.0, 10
    rr = UserRandomizedResponse(eps, m, seed=0)
    private, report = rr.privatize(_pairs(10_000, m))
    flipped = sum(c.startswith("r") for c in private["chosen"])
    n = len(private)
    assert n == 100_000
    p = 1 - 1 / (1 + math.exp(-eps / m))
    lo, hi = stats.binom.interval(0.999, n, p)
    assert lo <= flipped <= hi
    assert "labels_changed" not in report.extra  # the count would reveal the last user's labels
    # a flipped pair is the same pair the other way round
    for c, r in zip(private["chosen"][:200], private["rejected"][:200]):
        assert c[1:] == r[1:] and {c[0], r[0]} == {"c", "r"}


def test_the_report_gives_eps_per_user_and_dp_accounting_agrees():
    eps, m = 2.0, 8
    rr = UserRandomizedResponse(eps, m, seed=1)
    private, report = rr.privatize(_pairs(50, m, extra=5))
    assert report.epsilon == eps and report.delta == 0.0 and report.neighboring_relation == "replace"
    assert len(private) == 50 * m and report.max_samples_per_user == m and "rows_dropped" not in report.to_dict()
    assert rr.epsilon_per_label == eps / m
    event = randomized_response_event(eps, m)
    assert compute_delta(event, eps, accountant="pld", relation="replace") == 0.0  # pure ε-DP per user
    assert compute_epsilon(event, 1e-12, accountant="pld", relation="replace") <= eps + 1e-9


def test_labels_are_privatized_once():
    rr = UserRandomizedResponse(1.0, 4, seed=0)
    private, _ = rr.privatize(_pairs(20, 4))
    assert set(private[PRIVATIZED_COLUMN]) == {0.25}
    with pytest.raises(ValueError, match="already privatized"):
        rr.privatize(private)
    again, _ = UserRandomizedResponse(1.0, 4, seed=0).privatize(_pairs(20, 4))
    assert again["chosen"] == private["chosen"]  # seeded: the same flips, not fresh ones


def test_k_wise_randomized_response_keeps_and_moves_uniformly():
    k, eps, m = 4, 2.0, 2
    n_users = 50_000
    labels = np.tile([0, 1, 2, 3], n_users * m // 4)
    ds = Dataset.from_dict({"label": labels.tolist(), "user_id": np.repeat(np.arange(n_users), m).tolist()})
    rr = UserRandomizedResponse(eps, m, num_choices=k, seed=3)
    private, report = rr.privatize(ds, label_column="label")
    new = np.asarray(private["label"])
    old = np.asarray(ds["label"])
    keep = math.exp(eps / m) / (math.exp(eps / m) + k - 1)
    lo, hi = stats.binom.interval(0.999, len(new), keep)
    assert lo <= (new == old).sum() <= hi
    moved_by = ((new - old) % k)[new != old]
    counts = np.bincount(moved_by, minlength=k)[1:]
    assert stats.chisquare(counts).pvalue > 1e-3  # each other label equally likely
    assert report.extra["num_choices"] == 4


@pytest.mark.parametrize(
    "make,kwargs,match",
    [
        (lambda: Dataset.from_dict({"chosen": ["a"], "user_id": [1]}), {}, "rejected"),
        (lambda: Dataset.from_dict({"label": [0.0, float("nan")], "user_id": [1, 2]}), {"label_column": "label"}, "NaN"),
        (lambda: Dataset.from_dict({"label": [0.0, 1.5], "user_id": [1, 2]}), {"label_column": "label"}, "non-integer"),
        (lambda: Dataset.from_dict({"label": [0, 5], "user_id": [1, 2]}), {"label_column": "label"}, r"\[0, 2\)"),
        (lambda: Dataset.from_dict({"label": [0, 1]}), {"label_column": "label"}, "user column"),
        (lambda: Dataset.from_dict({"label": [0, 1], "user_id": [1, 2]}), {"label_column": "y"}, "no label column"),
        (lambda: Dataset.from_dict({"chosen": ["a"], "rejected": ["b"], "chosen_ids": [[1]], "rejected_ids": [[2]],
                                    "user_id": [1]}), {}, "depend on the private labels"),
        (lambda: Dataset.from_dict({"chosen": ["a"], "rejected": ["b"], "margin": [0.3], "user_id": [1]}), {},
         "depend on the private labels"),
    ],
)
def test_bad_datasets_raise(make, kwargs, match):
    with pytest.raises(ValueError, match=match):
        UserRandomizedResponse(1.0, 2, seed=0).privatize(make(), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(epsilon=0.0, max_samples_per_user=2), "epsilon must be"),
    (dict(epsilon=1.0, max_samples_per_user=0), "max_samples_per_user must be"),
    (dict(epsilon=1.0, max_samples_per_user=2, num_choices=1), "num_choices must be"),
])
def test_bad_parameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UserRandomizedResponse(**kwargs)


def test_a_user_column_whose_name_contains_label_is_not_mistaken_for_a_label():
    """Label-derived columns are found by whole words (issue 11, item 8): ``labeller`` is a person, while
    ``chosen_score`` still depends on the labels."""
    data = _pairs(5, 2).rename_column("user_id", "labeller")
    private, report = UserRandomizedResponse(1.0, 2, seed=0).privatize(data, user_column="labeller")
    assert report.n_users == 5 and "labeller" in private.column_names
    with pytest.raises(ValueError, match="depend on the private labels"):
        UserRandomizedResponse(1.0, 2, seed=0).privatize(
            data.add_column("chosen_score", [0.0] * len(data)), user_column="labeller")


def test_privatize_once_draws_once_per_directory_and_refuses_other_data(tmp_path):
    rr = UserRandomizedResponse(1.0, 4)  # no seed: every draw is fresh OS randomness
    data = _pairs(30, 5)  # 5 rows per user, bound m = 4: the kept rows are drawn too
    first, report = rr.privatize_once(data, str(tmp_path))
    again, again_report = UserRandomizedResponse(1.0, 4).privatize_once(data, str(tmp_path))
    assert again.to_dict() == first.to_dict() and again_report == report
    fresh, _ = rr.privatize(data)
    assert fresh.to_dict() != first.to_dict()  # a new draw differs, so the reuse above is not luck
    for other, match in [(_pairs(31, 5), "the users differ"), (_pairs(30, 6), "a user's rows differ")]:
        with pytest.raises(ValueError, match=match):
            rr.privatize_once(other, str(tmp_path))
    with pytest.raises(ValueError, match="another ε/m"):
        UserRandomizedResponse(2.0, 4).privatize_once(data, str(tmp_path))
