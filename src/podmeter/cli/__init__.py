"""podmeter.cli."""
