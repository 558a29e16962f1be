"""Distributed inference: cost-balanced samplers, the work pool that redoes a failed
rank's share, and the gather of results to rank 0 in dataset order."""
