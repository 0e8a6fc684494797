"""The public gRPC API (``tandem.v1``, source ``generation.proto``) and its generated code.

``python -m tandem.proto.generate`` regenerates ``generation_pb2*.py``; never edit those by hand.
"""
