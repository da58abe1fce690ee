"""What every server benchmark shares: the HTTP client (:mod:`.client`) and the server's start, health
wait and stop (``server.sh``, sourced by each campaign's run script)."""
