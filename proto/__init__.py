"""The public gRPC API (``tandem.v1``) and its generated code: arrives with the cluster."""
