"""Framework adapters: each turns one framework's tensors into the core's readings, imported on demand."""
