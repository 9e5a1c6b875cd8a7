"""Pure algorithm math on tensors, selected by name from small registries."""

from vlrft.algo.advantages import GROUP_ESTIMATORS
from vlrft.algo.estimate import ADVANTAGES  # importing estimate registers the estimators
from vlrft.algo.aggregate import LOSS_AGG_MODES, aggregate, normaliser_counts
from vlrft.algo.kl import KL_ESTIMATORS
from vlrft.algo.losses import POLICY_LOSSES

__all__ = [
    "ADVANTAGES",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "aggregate",
    "normaliser_counts",
]
