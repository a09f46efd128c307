"""Built-in executors: `model` (the real forward) and `simulated` (a cost model)."""
