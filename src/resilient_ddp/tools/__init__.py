"""What runs a job: the local launcher (``rd.spawn``), ``python -m resilient_ddp demo``
and ``doctor``."""
