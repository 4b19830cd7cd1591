"""User-level data pipeline: user ids, contribution bounding, Poisson sampling over users,
collation that keeps each row's user (docs/privacy_model.md)."""

from .bounding import BoundingReport, UserSubset, bound_contributions
from .collate import UserBatch, UserCollator, UserTaggedDataset, empty_like
from .loader import PhasedUserDataLoader, UserDataLoader
from .sampler import UserPoissonSampler
from .text import check_text_columns
from .users import DEFAULT_USER_COLUMN, UserIndex, resolve_user_ids

__all__ = [
    "DEFAULT_USER_COLUMN",
    "BoundingReport",
    "PhasedUserDataLoader",
    "UserBatch",
    "UserCollator",
    "UserDataLoader",
    "UserIndex",
    "UserPoissonSampler",
    "UserSubset",
    "UserTaggedDataset",
    "bound_contributions",
    "check_text_columns",
    "empty_like",
    "resolve_user_ids",
]
