"""The trace simulator: replay job traces against the real placement and planning code."""
