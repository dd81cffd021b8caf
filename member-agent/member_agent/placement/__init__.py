"""Pure placement: the GPU limits check, and which nodes and GPUs for every pod of a gang."""
