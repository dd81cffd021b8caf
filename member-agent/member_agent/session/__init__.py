"""The agent's session with the broker: connect, replay state, reconnect."""
