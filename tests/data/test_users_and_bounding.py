import numpy as np
import pandas as pd
import pytest
import torch
from datasets import Dataset
from torch.utils.data import TensorDataset

from trl_userdp.data import UserSubset, bound_contributions, resolve_user_ids


def _hf(n_rows=60, n_users=7):
    rng = np.random.default_rng(0)
    users = rng.integers(0, n_users, n_rows)
    return Dataset.from_dict({"x": list(range(n_rows)), "user_id": [f"u{u}" for u in users]})


def test_bounding_keeps_at_most_m_rows_per_user_and_reports_it():
    ds = _hf()
    counts_in = np.bincount(resolve_user_ids(ds).codes)
    bounded, report = bound_contributions(ds, 5, seed=3)
    counts = np.bincount(resolve_user_ids(bounded).codes)
    assert isinstance(bounded, Dataset) and "user_id" in bounded.column_names
    assert counts.max() <= 5
    np.testing.assert_array_equal(counts, np.minimum(counts_in, 5))  # users under the bound keep every row
    assert report.rows_in == 60 and report.rows_kept == len(bounded) == counts.sum()
    assert report.rows_dropped == 60 - counts.sum() and report.n_users == 7
    assert report.users_truncated == int((counts_in > 5).sum())
    assert bounded["x"] == sorted(bounded["x"])  # original order kept


def test_bounding_is_seeded_uniform_and_idempotent():
    ds = _hf()
    a, _ = bound_contributions(ds, 3, seed=1)
    b, _ = bound_contributions(ds, 3, seed=1)
    c, _ = bound_contributions(ds, 3, seed=2)
    assert a["x"] == b["x"] and a["x"] != c["x"]
    again, report = bound_contributions(a, 3, seed=9)
    assert again["x"] == a["x"] and report.rows_dropped == 0
    # uniform: over many seeds each of a user's 6 rows is kept about half of the time (3 of 6)
    ds6 = Dataset.from_dict({"x": list(range(6)), "user_id": [0] * 6})
    kept = np.zeros(6)
    for seed in range(2000):
        kept[bound_contributions(ds6, 3, seed=seed)[0]["x"]] += 1
    assert np.all(np.abs(kept / 2000 - 0.5) < 0.05)


def test_torch_dataset_with_user_ids_becomes_a_user_subset():
    td = TensorDataset(torch.arange(10.0))
    bounded, report = bound_contributions(td, 2, user_ids=[0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    assert isinstance(bounded, UserSubset)
    assert len(bounded) == report.rows_kept == 7
    assert sorted(bounded.user_ids) == [0, 0, 1, 1, 2, 2, 3]
    index = resolve_user_ids(bounded)  # the subset carries its user ids
    assert index.n_users == 4 and index.counts.max() == 2


@pytest.mark.parametrize(
    "make,kwargs,match",
    [
        (lambda: Dataset.from_dict({"x": [1, 2]}), {}, "no user column 'user_id'"),
        (lambda: Dataset.from_dict({"x": [1, 2], "author": [1, 2]}), {"user_column": "user"}, "no user column 'user'"),
        (lambda: Dataset.from_dict({"x": [1, 2], "user_id": ["a", None]}), {}, "no user id"),
        (lambda: TensorDataset(torch.zeros(3)), {}, "pass `user_ids=`"),
        (lambda: TensorDataset(torch.zeros(3)), {"user_ids": [1, float("nan"), 2]}, "no user id"),
        (lambda: TensorDataset(torch.zeros(3)), {"user_ids": [1, np.float32("nan"), 2]}, "no user id"),
        (lambda: TensorDataset(torch.zeros(3)), {"user_ids": np.array([1.0, np.nan, 2.0])}, "no user id"),
        (lambda: TensorDataset(torch.zeros(3)), {"user_ids": torch.tensor([1.0, float("nan"), 2.0])}, "no user id"),
        (lambda: TensorDataset(torch.zeros(3)), {"user_ids": [1, torch.tensor(float("nan")), 2]}, "no user id"),
        (lambda: TensorDataset(torch.zeros(3)), {"user_ids": [1, pd.NA, 2]}, "no user id"),
        (lambda: TensorDataset(torch.zeros(3)), {"user_ids": [1, 2]}, "2 entries"),
    ],
)
def test_bad_user_ids_raise_before_any_work(make, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bound_contributions(make(), 2, **kwargs)


@pytest.mark.parametrize("m", [0, -1, 2.5, None, True])
def test_bad_bound_raises(m):
    with pytest.raises(ValueError, match="max_samples_per_user"):
        bound_contributions(_hf(), m)


def test_a_users_kept_rows_do_not_depend_on_other_users():
    """Bounding neighbouring datasets (one user removed) must change that user's rows only."""
    rng = np.random.default_rng(0)
    users = rng.integers(0, 50, 1000)
    full = Dataset.from_dict({"x": list(range(1000)), "user_id": users.tolist()})
    without_0 = full.filter(lambda r: r["user_id"] != 0)
    a, _ = bound_contributions(full, 3, seed=5)
    b, _ = bound_contributions(without_0, 3, seed=5)
    kept_a = {(u, x) for u, x in zip(a["user_id"], a["x"]) if u != 0}
    kept_b = set(zip(b["user_id"], b["x"]))
    assert kept_a == kept_b
