"""The front end: plan bytes to a checked, typed plan IR, with every problem found as a diagnostic; no torch."""
