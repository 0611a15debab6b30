"""PadCaptioner on Ray: the core (config, schema, layout, model families, metrics) and the driver."""

__version__ = "0.1.0"
