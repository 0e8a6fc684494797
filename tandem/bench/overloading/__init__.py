"""Helpers of `tandem bench overload`: the traffic, the memory watch, the summary and the plots."""
