"""Pod creation and deletion, all-or-nothing with rollback."""
