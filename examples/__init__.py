"""Examples that use specroll as an external service."""
