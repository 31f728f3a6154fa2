"""Load harness: scenarios, a runner that records every request and samples the backend's /metrics, and
``compare`` (direct vs through kvgate vs vLLM's own queue limit). See loadtests/README.md."""
