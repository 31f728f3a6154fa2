"""What the OpenAI API says, on the wire: request bodies parsed into what admission needs, and error shapes.

Owns: :mod:`.requests` (parse a body, 400 on what the gateway relies on), :mod:`.errors` (OpenAI-shaped
errors with Retry-After). May import: nothing of the gateway but :mod:`gateway.config`. Everything imports it.
"""
