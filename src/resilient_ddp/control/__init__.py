"""The control plane: the store, every key under one root, the records ranks exchange
(heartbeats, failure events, verdicts), torchrun's error file and this process's board."""
