import numpy as np
import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from torch.utils.data import DataLoader, TensorDataset
from trl.trainer.reward_trainer import DataCollatorForPreference

from trl_userdp.data import (
    UserCollator,
    UserDataLoader,
    UserPoissonSampler,
    UserTaggedDataset,
    empty_like,
    resolve_user_ids,
)


def _pref_dataset(n=24, n_users=6):
    rng = np.random.default_rng(0)
    return Dataset.from_dict(
        {
            "chosen_ids": [list(rng.integers(5, 50, rng.integers(2, 6))) for _ in range(n)],
            "rejected_ids": [list(rng.integers(5, 50, rng.integers(2, 6))) for _ in range(n)],
            "user_id": [int(u) for u in rng.integers(0, n_users, n)],
        }
    )


def test_trl_preference_collator_keeps_users_in_chosen_rejected_layout():
    ds = _pref_dataset()
    index = resolve_user_ids(ds)
    tagged = UserTaggedDataset(ds, index.codes, "user_id")
    collate = UserCollator(DataCollatorForPreference(pad_token_id=0), template=tagged[0][0], rows_per_example=2)
    batch, row_users = collate([tagged[i] for i in (0, 3, 5)])
    assert batch["input_ids"].shape[0] == 6
    users = index.codes[[0, 3, 5]].tolist()
    assert row_users.tolist() == users + users  # row i and B+i: same pair, same user
    empty, no_users = collate([])
    assert set(empty) == set(batch) and no_users.numel() == 0
    for k in batch:
        assert empty[k].shape[0] == 0 and empty[k].dtype == batch[k].dtype and empty[k].dim() == batch[k].dim()


def test_empty_like_keeps_structure():
    batch = {"a": torch.ones(2, 3), "b": [torch.ones(2), torch.zeros(2, 1)], "names": ["x", "y"], "n": 3}
    out = empty_like(batch)
    assert out["a"].shape == (0, 3) and out["b"][1].shape == (0, 1) and out["names"] == [] and out["n"] == 3


def test_accelerate_prepare_keeps_poisson_batches_and_empty_steps():
    ds = _pref_dataset()
    index = resolve_user_ids(ds)
    tagged = UserTaggedDataset(ds, index.codes, "user_id")
    sampler = UserPoissonSampler(index, users_per_batch=1, steps=40, seed=0)
    reference = UserPoissonSampler(index, users_per_batch=1, steps=40, seed=0)
    reference.set_epoch(0)  # accelerate's DataLoaderShard sets the epoch before iterating
    expected = list(reference)
    collate = UserCollator(DataCollatorForPreference(pad_token_id=0), template=tagged[0][0], rows_per_example=2, user_key="user_id")
    loader = Accelerator(cpu=True).prepare(DataLoader(tagged, batch_sampler=sampler, collate_fn=collate))
    batches = list(loader)
    assert len(batches) == 40
    assert any(b["input_ids"].shape[0] == 0 for b in batches)
    for b, rows in zip(batches, expected):
        assert b["user_id"].tolist() == index.codes[rows].tolist() * 2
        assert b["input_ids"].shape[0] == 2 * len(rows)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_user_data_loader_records_the_map_of_the_yielded_batch(num_workers):
    n = 60
    users = [i % 9 for i in range(n)]
    loader = UserDataLoader(
        TensorDataset(torch.arange(n), torch.randn(n, 2)), users_per_batch=3, user_ids=users, steps=30, seed=0,
        num_workers=num_workers,
    )
    seen = []
    loader.add_batch_callback(lambda r, continuation: seen.append(r.clone()))
    code = resolve_user_ids(TensorDataset(torch.zeros(n)), user_ids=users).codes
    for step, (rows, x) in enumerate(loader):
        assert loader.last_row_users.tolist() == code[rows.numpy()].tolist()
        assert torch.equal(seen[step], loader.last_row_users)
        assert x.shape == (len(rows), 2)
    assert len(seen) == 30 == len(loader)
    assert loader.sample_rate == pytest.approx(3 / 9)


def test_user_data_loader_removes_the_user_column_and_rejects_unbounded_users():
    ds = Dataset.from_dict({"x": [[1.0, 2.0]] * 8, "user_id": [0, 0, 0, 1, 1, 2, 2, 2]}).with_format("torch")
    loader = UserDataLoader(ds, users_per_batch=3, steps=1, seed=0)
    (batch,) = list(loader)
    assert set(batch) == {"x"} and batch["x"].shape == (8, 2)
    with pytest.raises(ValueError, match="more than max_samples_per_user=2"):
        UserDataLoader(ds, users_per_batch=1, max_samples_per_user=2)
    with pytest.raises(ValueError, match="batch_size"):
        UserDataLoader(ds, users_per_batch=1, batch_size=4)
    for bad_m in (0, 2.5):
        with pytest.raises(ValueError, match="max_samples_per_user must be an integer >= 1"):
            UserDataLoader(ds, users_per_batch=1, max_samples_per_user=bad_m)
