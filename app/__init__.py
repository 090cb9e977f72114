"""rendezvous: prefill/decode disaggregated LLM serving on Ray Serve with NIXL push transfer."""
