"""Plain data stages: prompt sources, filtering of teacher output, tokenization into Parquet."""
