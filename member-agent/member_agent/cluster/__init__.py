"""The cluster the agent runs in: the ClusterBackend protocol, kubernetes and simulated."""
