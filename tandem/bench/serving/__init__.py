"""Helpers of `tandem bench serve`: the load generator and its OpenAI client, the clusters it
starts (local), the colocated budget sweep, the max-SLO-rate search, the time breakdown from
/metrics, the overhead probe, the report and the plots."""
