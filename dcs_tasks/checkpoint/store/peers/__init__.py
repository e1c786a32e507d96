"""The memory tier's peer transport (store stage): a committed step directory copied between two hosts' memory
tiers over TCP. `channel`: the authenticated connection (framed JSON headers, HMAC-SHA256 tags); `stepfiles`: a
step's name on the wire and its directory received, verified and installed, or sent; `transfer`: the server and
its operations (push, pull, list). This file stays a docstring (a re-export would be an import edge)."""
