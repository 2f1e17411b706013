"""Configuration: the schema, its readers, and bucket plans."""
