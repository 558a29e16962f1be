"""This process's view of the job (``Runtime``: who it is, what it is doing, what failed)
and its process hooks (uncaught exceptions, signals, the exit guard)."""
