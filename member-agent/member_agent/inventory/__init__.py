"""Nodes and pods turned into GPU inventory, the summary sent to the broker, fragmentation."""
