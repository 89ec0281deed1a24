"""Request lifecycle, step loop and outputs (see shared/docs/design.md §2)."""
