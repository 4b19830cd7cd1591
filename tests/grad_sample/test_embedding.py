"""The embedding samplers honour ``padding_idx`` as autograd does (Opacus's scatter every position, the padding row's
included), so a pad token that is also a real token (an EOS, a sampled token) no longer breaks per-user gradients."""

import torch
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.embedding import compute_embedding_grad_sample
from torch import nn

from trl_userdp.grad_sample.embedding import embedding_grad_sample, embedding_norm_sample


def _case():
    torch.manual_seed(0)
    layer = nn.Embedding(10, 4, padding_idx=0)
    ids = torch.tensor([[0, 3, 0, 5], [2, 0, 2, 9], [1, 1, 1, 1]])  # the pad id at positions with a gradient
    backprops = torch.randn(3, 4, 4)
    return layer, ids, backprops


def _autograd_per_sample(layer, ids, backprops):
    grads = []
    for i in range(len(ids)):
        layer.zero_grad()
        (layer(ids[i:i + 1]) * backprops[i:i + 1]).sum().backward()
        grads.append(layer.weight.grad.clone())
    return torch.stack(grads)


def test_per_sample_gradients_and_norms_equal_autograds_with_a_padding_idx():
    layer, ids, backprops = _case()
    expected = _autograd_per_sample(layer, ids, backprops)
    assert expected[:, 0].abs().sum() == 0  # autograd leaves the padding row alone
    opacus = compute_embedding_grad_sample(layer, [ids], backprops)[layer.weight]
    assert opacus[:, 0].abs().sum() > 0  # ... Opacus's sampler does not: the defect these samplers fix
    torch.testing.assert_close(embedding_grad_sample(layer, [ids], backprops)[layer.weight], expected)
    norms = embedding_norm_sample(layer, [ids], backprops)[layer.weight]
    torch.testing.assert_close(norms, expected.flatten(1).norm(dim=1))


def test_the_samplers_are_the_ones_opacus_uses():
    layer, ids, backprops = _case()
    module = GradSampleModule(nn.Sequential(layer), loss_reduction="sum")
    (module(ids) * backprops).sum().backward()
    torch.testing.assert_close(layer.weight.grad_sample, _autograd_per_sample(layer, ids, backprops))


class _OwnIds(nn.Embedding):
    """Computes the ids it looks up from its argument (as OPT's learned positions do from the attention mask)."""

    def forward(self, mask, offset=2):
        return super().forward(mask.cumsum(-1) * mask + offset)


def test_an_embedding_that_computes_its_ids_hands_opacus_those_ids_and_gets_its_class_back():
    from trl_userdp.grad_sample import UserGradSampleHooks

    torch.manual_seed(0)
    layer = _OwnIds(12, 3)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    hooks = UserGradSampleHooks(layer)
    assert type(layer) is not _OwnIds and isinstance(layer, _OwnIds)
    hooks.set_row_users(torch.tensor([0, 1, 1]))
    backprops = torch.randn(3, 4, 3)
    (layer(mask, 2) * backprops).sum().backward()
    expected = [_autograd_per_sample_own(mask[rows], backprops[rows]) for rows in ([0], [1, 2])]
    torch.testing.assert_close(layer.weight.grad_sample, 3 * torch.stack(expected))  # Opacus's mean scaling: ×R
    hooks.cleanup()
    assert type(layer) is _OwnIds


def _autograd_per_sample_own(mask, backprops):
    torch.manual_seed(0)
    reference = _OwnIds(12, 3)
    (reference(mask, 2) * backprops).sum().backward()
    return reference.weight.grad
