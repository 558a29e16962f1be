"""Bounded operations: collectives with a deadline that raise typed errors naming the
culprit, torch's own collectives bounded, and checkpoint loading shared over the group."""
