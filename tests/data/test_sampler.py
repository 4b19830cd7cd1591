import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset

from trl_userdp.data import UserIndex, UserPoissonSampler, bound_contributions, resolve_user_ids


def _index(n_users=40, seed=0, max_rows=4):
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(n_users), rng.integers(1, max_rows + 1, n_users))
    return UserIndex.from_ids(rng.permutation(ids))


def _users_in(batch, index):
    return set(index.codes[batch].tolist())


def test_each_users_inclusion_frequency_is_binomial_with_rate_q():
    index = _index()
    sampler = UserPoissonSampler(index, users_per_batch=4, steps=5000, seed=0)
    assert sampler.sample_rate == pytest.approx(0.1)
    hits = np.zeros(index.n_users)
    for batch in sampler:
        for u in _users_in(batch, index):
            hits[u] += 1
    lo, hi = stats.binom.interval(0.999, 5000, 0.1)
    assert np.all((hits >= lo) & (hits <= hi)), (hits.min(), hits.max(), lo, hi)


def test_a_sampled_user_brings_all_its_rows_and_never_more_than_m():
    rng = np.random.default_rng(1)
    users = rng.integers(0, 30, 300)
    td = TensorDataset(torch.arange(300))
    bounded, _ = bound_contributions(td, 5, user_ids=users.tolist())
    index = resolve_user_ids(bounded)
    for batch in UserPoissonSampler(index, users_per_batch=5, steps=300, seed=2):
        codes = index.codes[batch]
        for u in set(codes.tolist()):
            assert sorted(np.array(batch)[codes == u].tolist()) == index.rows[u].tolist()
            assert (codes == u).sum() <= 5


def test_empty_steps_are_yielded_not_skipped():
    index = _index(n_users=10)
    sampler = UserPoissonSampler(index, users_per_batch=0.5, steps=400, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 400
    empty = sum(len(b) == 0 for b in batches)
    lo, hi = stats.binom.interval(0.999, 400, 0.95**10)
    assert lo <= empty <= hi


def test_default_steps_is_one_epoch_in_expectation():
    assert len(UserPoissonSampler(_index(n_users=50), users_per_batch=5, seed=0)) == 10


def test_truncation_and_per_step_record_draws():
    index = _index(n_users=40, max_rows=6)
    sampler = UserPoissonSampler(index, users_per_batch=10, max_users_per_batch=11, samples_per_user=2, steps=500, seed=4)
    sizes = []
    for batch in sampler:
        codes = index.codes[batch]
        sizes.append(len(set(codes.tolist())))
        assert np.bincount(codes, minlength=40).max() <= 2
    assert max(sizes) == 11  # Poisson(10) exceeds 11 often in 500 steps, and is cut back to 11


def test_replicas_partition_the_same_step():
    index = _index()
    whole = list(UserPoissonSampler(index, users_per_batch=8, steps=50, seed=7))
    parts = [list(UserPoissonSampler(index, users_per_batch=8, steps=50, seed=7, num_replicas=2, rank=r)) for r in (0, 1)]
    for step, full in enumerate(whole):
        a, b = parts[0][step], parts[1][step]
        assert not set(a) & set(b)
        assert sorted(a + b) == sorted(full)


def test_same_seed_same_batches_and_dataloader_compatible():
    index = _index()
    a = list(UserPoissonSampler(index, users_per_batch=4, steps=20, seed=3))
    b = list(UserPoissonSampler(index, users_per_batch=4, steps=20, seed=3))
    assert a == b
    ds = TensorDataset(torch.arange(index.n_rows))
    # a collate that accepts the empty steps (torch's default one fails on them; UserDataLoader shapes them)
    loader = DataLoader(ds, batch_sampler=UserPoissonSampler(index, users_per_batch=4, steps=20, seed=3),
                        collate_fn=lambda rows: [int(x) for (x,) in rows])
    assert list(loader) == a


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(users_per_batch=41), "exceeds the number of users"),
        (dict(users_per_batch=0), "users_per_batch"),
        (dict(users_per_batch=4, max_users_per_batch=3), "max_users_per_batch"),
        (dict(users_per_batch=4, num_replicas=2, rank=0), "seed"),
        (dict(users_per_batch=4, samples_per_user=0), "samples_per_user"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UserPoissonSampler(_index(), **kwargs)


def test_set_epoch_gives_each_epoch_fresh_draws_and_replays_an_epoch_exactly():
    index = _index()
    sampler = UserPoissonSampler(index, users_per_batch=4, steps=30, seed=5)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1
    resumed = UserPoissonSampler(index, users_per_batch=4, steps=30, seed=5)
    resumed.set_epoch(1)
    assert list(resumed) == epoch1
