"""The agent's session with the broker: connect, hello, heartbeats, reconnect, summaries."""
