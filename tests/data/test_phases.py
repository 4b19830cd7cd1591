"""AUP-RLHF Alg. 1 phases: shares, keyed assignment, phase datasets and the phased loader."""

import pytest
import torch
from scipy import stats
from torch.utils.data import TensorDataset

from trl_userdp.data import PhasedUserDataLoader, UserDataLoader, UserIndex
from trl_userdp.data.phases import assign_phases, phase_datasets, phase_shares


def test_phase_shares_follow_alg_1():
    assert phase_shares(1, "all").tolist() == [1.0]
    assert phase_shares(1, "paper").tolist() == [0.5]  # Alg. 1 as written: half the users at k = 1
    assert phase_shares(3, "paper").tolist() == [0.125, 0.25, 0.5]
    assert phase_shares(3, "all") == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="phases"):
            phase_shares(bad)
    with pytest.raises(ValueError, match="phase_users"):
        phase_shares(2, "half")


def test_phase_sizes_are_binomial_in_the_shares():
    n = 4000
    phase = assign_phases(UserIndex.from_ids(range(n)), phase_shares(3, "paper"), seed=0)
    for i, share in enumerate([0.125, 0.25, 0.5, 0.125]):  # the last: users in no phase (-1)
        count = int((phase == (i if i < 3 else -1)).sum())
        lo, hi = stats.binom.interval(0.999, n, share)
        assert lo <= count <= hi, (i, count, lo, hi)


def _phases_by_user(keys, seed):
    index = UserIndex.from_ids(keys)
    return dict(zip(index.keys.tolist(), assign_phases(index, phase_shares(3, "all"), seed).tolist()))


def test_adding_a_user_moves_no_other_user_between_phases():
    keys = [f"u{i}" for i in range(500)]
    before, after = _phases_by_user(keys, seed=7), _phases_by_user(["new"] + keys, seed=7)
    assert all(after[k] == p for k, p in before.items())
    assert before != _phases_by_user(keys, seed=8)  # the split depends on the seed, not on the ids alone


def test_phase_datasets_hold_exactly_their_users_rows():
    ids = [i // 3 for i in range(300)]
    dataset = TensorDataset(torch.arange(300))
    index = UserIndex.from_ids(ids)
    phase = assign_phases(index, phase_shares(2, "paper"), seed=0)
    parts = phase_datasets(dataset, index, phase, 2)
    for i, part in enumerate(parts):
        users = set(part.user_ids)
        assert users == set(index.keys[phase == i].tolist())
        assert sorted(int(part[j][0]) for j in range(len(part))) == [r for r in range(300) if phase[ids[r]] == i]


def _phase_loader(n_users, steps, seed):
    ids = list(range(n_users))
    return UserDataLoader(TensorDataset(torch.tensor(ids)), users_per_batch=5, user_ids=ids, steps=steps, seed=seed)


def test_phased_loader_runs_phases_in_order_and_announces_each():
    loaders = [_phase_loader(20, 3, 0), _phase_loader(40, 4, 1)]
    phased = PhasedUserDataLoader(loaders, steps_per_iteration=2)
    seen, announced = [], []
    phased.add_phase_callback(lambda p: announced.append((p, len(seen))))
    for _ in range(10):  # more passes than needed: the schedule simply ends
        for _batch in phased:
            seen.append(phased.phase)
    assert seen == [0, 0, 0, 1, 1, 1, 1] and announced == [(1, 3)]
    assert phased.n_users == 60 and phased.sample_rate == pytest.approx(5 / 40)


def test_phased_loader_stops_when_told():
    phased = PhasedUserDataLoader([_phase_loader(20, 3, 0), _phase_loader(20, 3, 1)], steps_per_iteration=6)
    phased.stop_when = lambda: True
    assert list(phased) == []
