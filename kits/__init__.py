"""Runtime kits: bounded tables (`tables`), per-object memos (`memo`), the garbage
collector's housekeeping (`garbage`) and the fields bound to log lines (`logcontext`), for
the broker, the agent and the CLI alike (as kopf's `_cogs/`). They import nothing of gpufed;
whoever needs one makes it and hands it on, so no cache hides in the wire contract
(`broker.api`). Empty, so that importing one kit pulls in no other: the pure cores use
`tables`, which must not bring `garbage`'s asyncio and logging."""
