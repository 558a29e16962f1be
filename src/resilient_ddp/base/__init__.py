"""Ground: pure pieces every layer uses (clocks, the timing table, torch versions, backends,
stack formatting). Imports nothing else of the package."""
