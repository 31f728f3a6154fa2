"""The engine side: talking to vLLM.

Owns: :mod:`.http_client` (lean HTTP/1.1 client for the hot path), :mod:`.forwarder` (send a request, relay
its answer), :mod:`.engine_metrics` (parse vLLM's /metrics, pure), :mod:`.scraper` (scrape it on an interval
and publish samples to subscribers). May import: :mod:`gateway.admission` (the sample type),
:mod:`gateway.tokens`, :mod:`gateway.protocol`, :mod:`gateway.config`, :mod:`gateway.metrics`.
"""
