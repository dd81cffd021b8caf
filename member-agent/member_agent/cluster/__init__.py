"""The cluster the agent runs in: the ClusterBackend protocol (`base`), its errors and the GPU
health book both backends keep (`gpuhealth`); the backends are packages, `kubernetes` and
`simulated`, neither importing the other."""
