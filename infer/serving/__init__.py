"""The captioning endpoint: HTTP API, wire protocol, request bodies, request batching into the engine, Ray Serve shell."""
