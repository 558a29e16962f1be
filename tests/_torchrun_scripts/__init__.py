"""Scripts that tests start under real torchrun (run by path; the tests import their
constants and data functions too)."""
