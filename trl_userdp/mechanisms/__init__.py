"""Privacy mechanisms: user-level randomized response (labels, once, before training) and AUP-RLHF's
formulas (:mod:`trl_userdp.mechanisms.aup`, used by its optimizer, engine, linear estimator and the CLI)."""

from .randomized_response import PRIVATIZED_COLUMN, UserRandomizedResponse

__all__ = ["PRIVATIZED_COLUMN", "UserRandomizedResponse"]
