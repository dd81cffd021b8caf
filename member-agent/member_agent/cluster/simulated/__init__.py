"""The simulated backend (`backend.SimulatedBackend`): nodes from pools in a YAML file, pods on
timers and their journal (`pods`), injected GPU failures (`faults`)."""
