"""Pure placement: which nodes and GPUs for every pod of a gang."""
