"""The async engine loop and the OpenAI-compatible server (`servelab serve`)."""
