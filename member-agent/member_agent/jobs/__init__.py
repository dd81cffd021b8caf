"""The agent's job controller: offers, cancels, pod events, the job table, adoption at start."""
