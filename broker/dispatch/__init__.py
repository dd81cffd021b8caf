"""Agent sessions, offers, acknowledgements and fencing."""
