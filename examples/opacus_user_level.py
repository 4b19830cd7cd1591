"""User-level DP reward modelling in a plain PyTorch loop (no TRL).

A bag-of-words reward model learns which of two IMDb reviews a user prefers, from user-grouped
preference pairs (the embedded IMDb data: simulated users with heterogeneous label noise). The
privacy unit is the user: ``trl_userdp.PrivacyEngine.make_private_user_level`` bounds each user to
``m`` pairs, samples users, clips each user's averaged gradient and adds noise; ε is printed after
every epoch.

    python examples/opacus_user_level.py                       # ~1 min on CPU
    python examples/opacus_user_level.py --target_epsilon 8 --epochs 5
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

import trl_userdp
from trl_userdp.data.imdb import load_imdb_reviews, make_user_preference_pairs


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n_users", type=int, default=1000)
    p.add_argument("--pairs_per_user", type=int, default=10, help="pairs each simulated user labels")
    p.add_argument("--max_samples_per_user", type=int, default=10, help="contribution bound m")
    p.add_argument("--users_per_batch", type=float, default=50.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--target_epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2.0)
    p.add_argument("--vocab_size", type=int, default=2000)
    p.add_argument("--max_length", type=int, default=160)
    p.add_argument("--n_eval_pairs", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tokenize(texts: Sequence[str], vocab: dict, max_length: int) -> torch.Tensor:
    """Word ids (0 = padding, 1 = unknown), truncated and right-padded to ``max_length``."""
    out = torch.zeros(len(texts), max_length, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = [vocab.get(w, 1) for w in re.findall(r"[a-z']+", t.lower())[:max_length]]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


class BagOfWordsRewardModel(nn.Module):
    """r(text) = w · mean of word embeddings (padding excluded)."""

    def __init__(self, vocab_size: int, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.score = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids > 0).unsqueeze(-1).float()
        pooled = (self.embed(ids) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return self.score(pooled).squeeze(-1)


def pair_loss(model: nn.Module, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry loss, one forward over the [chosen; rejected] rows (mean over pairs)."""
    r_chosen, r_rejected = model(torch.cat([chosen, rejected])).chunk(2)
    return -nn.functional.logsigmoid(r_chosen - r_rejected).mean()


@torch.no_grad()
def accuracy(model: nn.Module, chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    return float((model(chosen) > model(rejected)).float().mean())


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    texts, labels = load_imdb_reviews()
    train, evaluation = make_user_preference_pairs(
        texts, labels, n_users=args.n_users, pairs_per_user=args.pairs_per_user,
        n_eval_pairs=args.n_eval_pairs, seed=args.seed,
    )
    # The vocabulary comes from the held-out texts only, so it spends no privacy budget.
    counts = Counter(w for t in list(evaluation["chosen"]) + list(evaluation["rejected"]) for w in re.findall(r"[a-z']+", t.lower()))
    vocab = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(args.vocab_size - 2))}
    data = TensorDataset(tokenize(train["chosen"], vocab, args.max_length), tokenize(train["rejected"], vocab, args.max_length))
    eval_chosen = tokenize(evaluation["chosen"], vocab, args.max_length)
    eval_rejected = tokenize(evaluation["rejected"], vocab, args.max_length)

    model = BagOfWordsRewardModel(args.vocab_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    engine = trl_userdp.PrivacyEngine(accountant="pld")
    model, optimizer, loader = engine.make_private_user_level(
        module=model, optimizer=optimizer, data_loader=DataLoader(data),
        target_epsilon=args.target_epsilon, target_delta=args.delta, epochs=args.epochs,
        max_grad_norm=args.max_grad_norm, max_samples_per_user=args.max_samples_per_user,
        users_per_batch=args.users_per_batch, user_ids=list(train["user_id"]),
        rows_per_example=2,  # the loss runs one forward over [chosen; rejected]
    )
    print(
        f"users n={engine.bounding.n_users}, m={args.max_samples_per_user} (rows dropped by bounding: "
        f"{engine.bounding.rows_dropped}), q={loader.sample_rate:.4f}, σ={optimizer.noise_multiplier:.3f}, "
        f"{len(loader)} steps per epoch"
    )
    print(f"before training: held-out pair accuracy {accuracy(model, eval_chosen, eval_rejected):.3f}")
    history = []
    for epoch in range(1, args.epochs + 1):
        for chosen, rejected in tqdm(loader, desc=f"epoch {epoch}", leave=False):
            optimizer.zero_grad()
            pair_loss(model, chosen, rejected).backward()
            optimizer.step()
        eps = engine.get_epsilon(args.delta)
        acc = accuracy(model, eval_chosen, eval_rejected)
        history.append({"epoch": epoch, "epsilon": eps, "accuracy": acc})
        print(f"epoch {epoch}: ε = {eps:.3f} (δ = {args.delta:g}, per user, add/remove one user), held-out accuracy {acc:.3f}")
    return {"history": history, "report": engine.privacy_report(args.delta)}


if __name__ == "__main__":
    main()
