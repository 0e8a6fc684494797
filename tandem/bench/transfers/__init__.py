"""Helpers of `tandem bench transfer`: one measured run per transport."""
