"""Dagster asset factories, one module per stage. Thin: read the spec, call a plain module or a
resource, write files, return metadata. Nothing here imports torch at module level."""
