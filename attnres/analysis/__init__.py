"""Looking inside trained models: depth-weight matrices and plots."""

from attnres.analysis.depth import depth_weight_matrix, record_on_batch

__all__ = ["depth_weight_matrix", "record_on_batch"]
