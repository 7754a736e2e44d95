"""tvsmt: prove that a parallel training plan computes what the single-device plan computes."""

__version__ = "0.1.0"
