"""Built-in cluster routers: one pluggy plugin per module."""
