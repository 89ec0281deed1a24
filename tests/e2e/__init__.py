"""End-to-end tests: the engine's batching and offline API, the command line and the HTTP server."""
