"""The wire contract of gpufed, shared by the broker, the member agent and the CLI.

Only this package of the broker may be imported by the member agent.
"""
