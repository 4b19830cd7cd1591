"""Label-privacy mechanisms applied to the data before training."""

from .randomized_response import PRIVATIZED_COLUMN, UserRandomizedResponse

__all__ = ["PRIVATIZED_COLUMN", "UserRandomizedResponse"]
