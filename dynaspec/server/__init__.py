"""The OpenAI-compatible HTTP server; needs the `server` extra (checked here, once, for all of
it)."""

from dynaspec.extras import require_extra

require_extra("server", "the HTTP server")
