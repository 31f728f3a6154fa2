"""The JSON Schema of the config file, generated from the pydantic models so it cannot drift from them.

Published as ``docs/kvgate.schema.json`` (a test checks it is current); point an editor at it, e.g. with a
``# yaml-language-server: $schema=...`` comment. Regenerate: ``python -m gateway.schema > docs/kvgate.schema.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from gateway.config import GatewayConfig

SCHEMA_ID = "https://github.com/kvgate/kvgate/blob/main/docs/kvgate.schema.json"


def config_schema() -> dict[str, Any]:
    schema = GatewayConfig.model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}


def render() -> str:
    return json.dumps(config_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
