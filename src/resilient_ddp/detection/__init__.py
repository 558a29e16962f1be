"""Failure detection: is a late rank working or stuck (progress signals), which ranks keep an
op from completing (diagnosis), and the watchdog thread that publishes heartbeats."""
