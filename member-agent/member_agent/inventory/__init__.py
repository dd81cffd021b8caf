"""Nodes and pods turned into GPU inventory, and the summary sent to the broker."""
