"""A fake third-party servelab plugin package (test fixture)."""
