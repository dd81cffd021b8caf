"""The local supervisor: run a broker and member agents as processes on loopback, and the demo."""
