"""Per-user gradients from the hooks equal a per-user autograd loop (docs/mechanisms.md, M1, issue 3)."""

import pytest
import torch

from ..helpers import assert_same_gradient, first_batch, make_private, pairs_by_user, sub_batch, user_grads
from ..tiny_models import MODELS, btl_pair_losses


@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_user_gradients_equal_a_per_user_autograd_loop(name):
    engine, model, optimizer, loader, reference = make_private(MODELS[name]())
    batch, row_users = first_batch(engine)
    btl_pair_losses(model, batch).mean().backward()
    grads = optimizer.unit_gradients()  # also runs the start-up self-check against autograd
    names = [engine.hooks.param_names[p] for p in optimizer.params]
    by_user = pairs_by_user(row_users)
    assert engine.hooks.unit_ids and set(engine.hooks.unit_ids) == set(by_user)
    for slot, user in enumerate(engine.hooks.unit_ids):
        expected = user_grads(reference, batch, by_user[user])
        assert_same_gradient({n: g[slot] for n, g in zip(names, grads)}, expected)


def test_micro_batches_of_one_step_merge_per_user():
    engine, model, optimizer, loader, reference = make_private(MODELS["llama"]())
    batch, row_users = first_batch(engine, min_users=3)
    by_user = pairs_by_user(row_users)
    b = len(row_users) // 2
    halves = [list(range(0, b // 2)), list(range(b // 2, b))]
    for half in halves:  # the same user may sit in both halves
        sub = sub_batch(batch, half)
        engine.hooks.set_row_users(torch.cat([row_users[half], row_users[half]]), continuation=True)
        btl_pair_losses(model, sub).mean().backward()
    grads = optimizer.unit_gradients()
    for slot, user in enumerate(engine.hooks.unit_ids):
        expected = user_grads(reference, batch, by_user[user])
        assert_same_gradient({engine.hooks.param_names[p]: g[slot] for p, g in zip(optimizer.params, grads)}, expected)


def test_rows_without_a_batch_dimension_raise_instead_of_a_wrong_gradient():
    class BadPositions(torch.nn.Module):  # a learned position embedding fed (1, T) positions, under a name not known
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(10, 4)
            self.where = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            pos = torch.arange(x.shape[1]).unsqueeze(0)
            return self.head(self.tok(x) + self.where(pos)).mean(1)

    from torch.utils.data import DataLoader, TensorDataset

    import trl_userdp

    model = BadPositions()
    engine = trl_userdp.PrivacyEngine()
    ds = TensorDataset(torch.randint(0, 10, (12, 5)))
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(ds),
        noise_multiplier=1.0, max_grad_norm=1.0, max_samples_per_user=2, users_per_batch=5, user_ids=list(range(6)) * 2,
    )
    (x,) = next(b for b in loader if len(b[0]) > 1)
    with pytest.raises(ValueError, match=r"Layer 'where' ran on a tensor of shape \(1, 5\), whose first dimension is "
                                         r"not the batch's \d+ rows"):
        model(x)


def test_the_per_user_averages_are_the_hooks_own_tensors_not_a_second_copy():
    """The optimizer averages the per-user sums in place: one [U, *p.shape] tensor per parameter, not two (issue 13)."""
    engine, model, optimizer, loader, reference = make_private(MODELS["llama"]())
    batch, row_users = first_batch(engine)
    btl_pair_losses(model, batch).mean().backward()
    sums = {p: p.grad_sample for p in optimizer.params}
    pointers = {p: s.data_ptr() for p, s in sums.items()}
    expected = {p: s.clone() / engine.hooks.unit_counts.view(-1, *([1] * (s.dim() - 1))) for p, s in sums.items()}
    grads = optimizer.unit_gradients()
    assert all(g.data_ptr() == pointers[p] for p, g in zip(optimizer.params, grads))
    assert all(torch.allclose(g, expected[p]) for p, g in zip(optimizer.params, grads))
    assert optimizer.unit_gradients() is grads  # a second call in the same step: the same averages
    with pytest.raises(ValueError, match="after this step's per-user gradients were averaged"):
        btl_pair_losses(model, batch).mean().backward()


@pytest.mark.parametrize("shared", ["one row", "a parameter with as many rows as the batch"])
def test_a_layer_run_once_for_every_row_is_refused_not_summed_into_one_user(shared):
    """DeBERTa's relative-position projections: a layer that also runs on a tensor shared by every row. Opacus would
    add that call's gradient (every user's) to the first row's user, and the users' sum would still match autograd's;
    the hooks refuse in the forward pass, even when the shared tensor happens to have as many rows as the batch."""
    from torch.utils.data import DataLoader, TensorDataset

    import trl_userdp

    class SharedBranch(torch.nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.rel = torch.nn.Embedding(rows, 4)  # read as a table (.weight), as DeBERTa's rel_embeddings
            self.proj = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)

        def forward(self, x):
            if shared == "one row":
                bias = self.proj(self.rel.weight.unsqueeze(0)).mean(1)  # (1, 4), broadcast over the rows
            else:
                bias = self.norm(self.rel.weight).mean(0)
            return (self.proj(x) + bias).sum(-1)

    torch.manual_seed(0)
    x = torch.randn(8, 4)
    model = SharedBranch(rows=4 if shared == "one row" else 8)
    engine = trl_userdp.PrivacyEngine()
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(TensorDataset(x)),
        noise_multiplier=0.0, max_grad_norm=1.0, max_samples_per_user=2, users_per_batch=4, user_ids=[0, 1, 2, 3] * 2,
    )
    (rows,) = next(iter(loader))
    assert len(rows) == 8  # every user drawn (q = 1), both rows
    match = r"shape \(1, 4, 4\)" if shared == "one row" else r"Layer 'norm' ran on a tensor of shape \(8, 4\)"
    with pytest.raises(ValueError, match=match + r".*cannot be separated"):
        model(rows)
