"""The `superinfer` command."""
