"""Async transport on stdlib HTTP: weight publishing, the rollout queue and the staleness policy.

Not written yet: the disaggregated trainer/rollout split lands with the async issue. Until then
train.py's sync source (sync_batch) is the only place batches come from.
"""
