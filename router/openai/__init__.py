"""An OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``) beside the gRPC one, on the router's own event loop and the same routing path:
requests become ``tandem.v1.GenerateRequest`` messages, checked by the same
``router.validation.validate_request``, and run on the same ``Backend``."""
