"""Helpers of `tandem bench serve`: the load generator, its OpenAI client, the overhead probe, the report and the plots."""
